"""The fleet config: paper-calibrated defaults, TOML in and out, overrides, and refusals that name
the field to fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.fleet import FleetConfig, FleetConfigError
from emulator.fleet.simulator import task_round_config
from server_stub.rounds import MAX_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[3]


def test_the_shipped_default_toml_is_the_default_config():
    assert FleetConfig.load(ROOT / "examples" / "fleets" / "default.toml") == FleetConfig.default()


def test_defaults_follow_the_paper():
    config = FleetConfig.default()
    assert config.task.goal_count == 100 and config.task.over_selection == 1.3  # sec. 9
    assert config.fleet.min_memory_mb == 2048  # sec. 11
    assert any(c.memory_mb < 2048 for c in config.device_classes)  # some phones are left out


def _weights(n: int):
    return st.lists(st.integers(1, 100), min_size=n, max_size=n).map(lambda w: [x / sum(w) for x in w])


@st.composite
def configs(draw):
    data = FleetConfig.default().model_dump()
    data["fleet"].update(
        devices=draw(st.integers(1, 10**6)),
        hours=draw(st.floats(0.5, 240.0, allow_nan=False)),
        seed=draw(st.integers(0, 2**63 - 1)),
        start_utc_hour=draw(st.floats(0.0, 23.99)),
    )
    zones = draw(st.lists(st.integers(-12, 14), min_size=1, max_size=5))
    data["availability"]["time_zones"] = [
        {"utc_offset_h": float(z), "share": s} for z, s in zip(zones, draw(_weights(len(zones))))
    ]
    for item, share in zip(data["runtime_versions"], draw(_weights(len(data["runtime_versions"])))):
        item["share"] = share
    data["faults"]["late_report_prob"] = draw(st.floats(0.0, 1.0))
    data["task"]["max_rounds"] = draw(st.none() | st.integers(1, 1000))
    data["availability"]["trace"] = draw(st.none() | st.text(min_size=1).map(lambda name: "/data/" + name))
    return FleetConfig.from_dict(data)


@settings(max_examples=40, deadline=None)
@given(configs())
def test_toml_round_trip_gives_an_equal_config(tmp_path_factory, config):
    path = tmp_path_factory.mktemp("toml") / "fleet.toml"
    path.write_text(config.to_toml(), encoding="utf-8")
    assert FleetConfig.load(path) == config


def test_replace_applies_overrides_and_validates_them():
    config = FleetConfig.default()
    changed = config.replace(devices=123, hours=2.5, seed=7)
    assert (changed.fleet.devices, changed.fleet.hours, changed.fleet.seed) == (123, 2.5, 7)
    assert changed.availability == config.availability and config.fleet.devices == 10_000
    assert config.replace() == config
    with pytest.raises(FleetConfigError, match=r"fleet\.devices"):
        config.replace(devices=0)
    smaller = config.replace(goal=12)
    assert smaller.task.goal_count == 12 and smaller.fleet == config.fleet
    with pytest.raises(FleetConfigError, match=r"task\.goal_count"):
        config.replace(goal=0)


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ("[fleet]\ndevices = 0", "fleet.devices"),
        ("[fleet]\ndevices = 10.5", "fleet.devices"),
        ('[fleet]\nseed = "7"', "fleet.seed"),
        ("[fleet]\nhours = nan", "fleet.hours"),
        ("[fleet]\nhours = inf", "fleet.hours"),
        ("[fleet]\ndevice = 10", "fleet.device"),
        ("[fleets]\ndevices = 10", "fleets"),
        ("[task]\nsecure = 1", "task.secure"),
        ("[task]\nover_selection = 0.9", "task.over_selection"),
        ("[task]\nretry_min_s = 10.0\nretry_max_s = 5.0", "retry_min_s"),
        ("[task]\nreport_timeout_s = 1e9", "task.report_timeout_s"),  # the server's timeouts stop at a week
        ("[task]\nselection_timeout_s = 604801.0", "task.selection_timeout_s"),
        ("[task]\nretry_max_s = 1e8", "task.retry_max_s"),
        ("[task]\nsecagg_round_timeout_s = 1e7", "task.secagg_round_timeout_s"),
        ("[availability.night]\nprobability = 1.5", "availability.night.probability"),
        ("[availability.night]\nduration_h = 30", "availability.night.duration_h"),  # would run into the next night
        ("[availability.night]\nmin_duration_h = 25", "availability.night.min_duration_h"),
        # spreads and rates past a day's: a device's windows were drawn day by day for minutes
        ("[availability.night]\nstart_device_sd_h = 1e9", "availability.night.start_device_sd_h must be at most 24"),
        ("[availability.night]\nwifi_before_h = 25", "availability.night.wifi_before_h must be at most 24"),
        ("[availability.day]\nmean_duration_h = 1e9", "availability.day.mean_duration_h must be at most 24"),
        ("[availability.day]\nsessions_per_day = 1e6", "availability.day.sessions_per_day must be at most 1440"),
        ("[availability.screen_on]\nper_hour = 61", "availability.screen_on.per_hour must be at most 60"),
        ("[availability.day]\nfrom_h = 20.0\nto_h = 8.0", "from_h"),
        ("[availability.battery]\nstart_min = 0.9\nstart_max = 0.2", "start_min"),
        ("[[availability.time_zones]]\nutc_offset_h = -5.0\nshare = 0.5", "availability.time_zones"),
        ("[[availability.time_zones]]\nutc_offset_h = 30.0\nshare = 1.0", "availability.time_zones.0.utc_offset_h"),
        ('[[device_classes]]\nname = "a"\nshare = 1.0\nspeed = 1.0\nmemory_mb = 1024', "min_memory_mb"),
        ('[[device_classes]]\nname = "a"\nshare = 0.0\nspeed = 1.0\nmemory_mb = 4096', "device_classes.0.share"),
        ('[[runtime_versions]]\nversion = "latest"\nshare = 1.0', "runtime_versions"),
        (
            '[[network_classes]]\nname = "x"\nshare = 0.5\ndown_mbps = 1.0\nup_mbps = 1.0\nlatency_ms = 1.0\n'
            '[[network_classes]]\nname = "x"\nshare = 0.5\ndown_mbps = 1.0\nup_mbps = 1.0\nlatency_ms = 1.0',
            "network_classes",
        ),
        ("[data]\nexamples_min = 50\nexamples_median = 10", "examples_min"),
        ('[data]\ndataset = "imagenet"', "data.dataset"),
    ],
)
def test_an_invalid_config_is_refused_naming_the_field(tmp_path, toml, field):
    path = tmp_path / "fleet.toml"
    path.write_text(toml, encoding="utf-8")
    with pytest.raises(FleetConfigError) as info:
        FleetConfig.load(path)
    assert field in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize(
    ("toml", "said"),
    [
        ('[task]\nfile = ""', "task.file must not be empty (got '')"),
        ('[data]\nformat = "leaf"\npath = ""', "data.path must not be empty (got '')"),
        (
            '[[device_classes]]\nname = "mid range"\nshare = 1.0\nspeed = 1.0\nmemory_mb = 4096',
            "device_classes.0.name may hold only ASCII letters, digits and _ . + - (got 'mid range')",
        ),
        (f'[task]\npopulation = "{"p" * 65}"', "task.population must be at most 64 characters long (got 65)"),
        ("[task]\nhidden = 32", "task.hidden must be an array in brackets (got 32)"),
        (
            '[runtime_versions]\nversion = "1.31.1"',
            "runtime_versions must be an array of tables ([[runtime_versions]])",
        ),
        (
            '[data]\nformat = "digits"\noptions = { clients = [1, 2] }',
            "data.options.clients must be text (in quotes), a whole number or a number (got [1, 2])",
        ),
    ],
)
def test_a_wrong_string_list_or_option_is_said_in_the_configs_words(tmp_path, toml, said):
    """These were pydantic's own words ("String should have at least 1 character", "String should
    match pattern '^[A-Za-z0-9_.+-]+$'"), hidden = 32 was told to be "an array of tables
    ([[task.hidden]])", and an option of the wrong kind three lines, one per kind tried."""
    path = tmp_path / "fleet.toml"
    path.write_text(toml, encoding="utf-8")
    with pytest.raises(FleetConfigError) as info:
        FleetConfig.load(path)
    assert str(info.value) == f"{path} is invalid: {said}"


def test_a_config_saved_with_a_byte_order_mark_is_read_and_one_saved_as_utf16_is_told_to_be_utf8(tmp_path):
    """Windows editors and PowerShell save UTF-8 with a byte order mark: the config was "not valid
    TOML (Invalid statement (at line 1, column 1)); fix the syntax", of a file that looks right in
    every editor; UTF-16 ("Unicode" in Notepad) was a UnicodeDecodeError's words."""
    text = "[fleet]\ndevices = 50\nhours = 0.5\n"
    (tmp_path / "bom.toml").write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert FleetConfig.load(tmp_path / "bom.toml") == FleetConfig.from_dict({"fleet": {"devices": 50, "hours": 0.5}})
    (tmp_path / "wide.toml").write_bytes(text.encode("utf-16"))
    with pytest.raises(FleetConfigError, match=r"^.*wide\.toml is UTF-16 text; TOML is UTF-8: save it as UTF-8$"):
        FleetConfig.load(tmp_path / "wide.toml")


def test_unreadable_files_are_refused_with_what_to_do(tmp_path):
    with pytest.raises(FleetConfigError, match="no fleet config"):
        FleetConfig.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[fleet\ndevices = 3", encoding="utf-8")
    with pytest.raises(FleetConfigError, match="not valid TOML"):
        FleetConfig.load(bad)
    with pytest.raises(FleetConfigError, match=r"cannot read the fleet config .*\(Is a directory\)"):
        FleetConfig.load(tmp_path)  # a folder given for the file


def test_a_relative_trace_path_is_read_next_to_the_config(tmp_path):
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "fleet.toml"
    path.write_text('[availability]\ntrace = "traces/day.csv"\n', encoding="utf-8")
    assert FleetConfig.load(path).availability.trace == str(tmp_path / "conf" / "traces" / "day.csv")


week = st.floats(0.001, MAX_TIMEOUT_S)


@settings(max_examples=200, deadline=None)
@given(
    selection=week,
    report=week,
    retry=st.tuples(st.floats(0.0, MAX_TIMEOUT_S), st.floats(0.0, MAX_TIMEOUT_S)),
    secagg=week,
    goal=st.integers(1, 1_000_000),
    over=st.floats(1.0, 100.0),
    fraction=st.floats(0.001, 1.0),
    group=st.integers(2, 100_000),
    secure=st.booleans(),
    max_rounds=st.none() | st.integers(1, 10**9),
)
def test_every_valid_task_section_is_a_round_configuration_the_server_takes(
    selection, report, retry, secagg, goal, over, fraction, group, secure, max_rounds
):
    """The section's bounds are the server's: a config that validates never fails later, when the
    simulator builds the server's round configuration from it."""
    data = FleetConfig.default().model_dump()
    data["task"].update(
        selection_timeout_s=selection,
        report_timeout_s=report,
        retry_min_s=min(retry),
        retry_max_s=max(retry),
        secagg_round_timeout_s=secagg,
        goal_count=goal,
        over_selection=over,
        min_fraction=fraction,
        secagg_group_size=group,
        secure=secure,
        max_rounds=max_rounds,
    )
    task = FleetConfig.from_dict(data).task
    config = task_round_config(task)
    assert (config.selection_timeout_s, config.report_timeout_s, config.retry_window_s) == (
        selection,
        report,
        (min(retry), max(retry)),
    )


def test_the_secure_group_size_a_round_aims_for_is_a_task_key_of_the_fleet():
    """A privacy engineer studies the protocol's cost against its group size from the fleet config,
    for the built-in task and over a task file's own RoundConfig alike."""
    from emulator.fleet.workload import overridden_round_config, task_round_config
    from server_stub import RoundConfig

    config = FleetConfig.from_dict({"task": {"secure": True, "secagg_target_group_size": 20}})
    assert task_round_config(config.task).secagg_target_group_size == 20
    assert task_round_config(FleetConfig.from_dict({"task": {"secure": True}}).task).secagg_target_group_size == 100
    rounds = overridden_round_config(RoundConfig(secagg_target_group_size=50), config.task)
    assert rounds.secagg_target_group_size == 20
    untouched = overridden_round_config(RoundConfig(secagg_target_group_size=50), FleetConfig.default().task)
    assert untouched.secagg_target_group_size == 50
    with pytest.raises(ValueError, match="secagg_target_group_size"):
        FleetConfig.from_dict({"task": {"secagg_target_group_size": 1}})


def test_a_data_options_true_or_false_is_the_specs_yes_or_no(tmp_path):
    """TOML's booleans for the data spec's yes/no options: a header-less CSV with ``header = false``."""
    from emulator.fleet.data import data_spec_text, fleet_data

    rows = "".join(f"c{i % 3},{i / 10},{i % 2}\n" for i in range(12))
    (tmp_path / "rows.csv").write_text(rows, encoding="utf-8")
    path = tmp_path / "fleet.toml"
    path.write_text(
        '[data]\nformat = "table"\npath = "rows.csv"\n'
        'options = { client = "f0", label = "f2", header = false, test_split = "clients" }\n',
        encoding="utf-8",
    )
    config = FleetConfig.load(path)
    assert data_spec_text(config.data).endswith(",client=f0,label=f2,header=no,test_split=clients")
    data = fleet_data(config)
    assert sorted([*data.dataset.train, *data.dataset.test]) == ["c0", "c1", "c2"]


def test_toml_holds_only_the_keys_that_were_set_so_a_task_files_round_config_holds_for_the_others(tmp_path):
    """A written-out config set every [task] key, which with a task file overrides the task's own
    RoundConfig: a run's recorded config then ran another fleet."""
    config = FleetConfig.default().replace(goal=6, hours=0.5)
    path = tmp_path / "fleet.toml"
    path.write_text(config.to_toml(), encoding="utf-8")
    loaded = FleetConfig.load(path)
    assert loaded == config and loaded.task.explicit == {"goal_count"}
    assert loaded.dump() == {"fleet": {"hours": 0.5}, "task": {"goal_count": 6}}
