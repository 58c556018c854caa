"""A task's DP settings travel in its RoundConfig, and out-of-range ones are refused by name."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server_stub import DPConfig, RoundConfig
from server_stub.accounting import MIN_NOISE_MULTIPLIER, MIN_SAMPLED_NOISE_MULTIPLIER


@given(
    z=st.just(0.0) | st.floats(MIN_NOISE_MULTIPLIER, 100.0),
    clip=st.floats(1e-3, 100.0),
    delta=st.floats(1e-12, 0.1),
    mode=st.sampled_from(["central", "distributed"]),
)
def test_dp_settings_survive_the_task_record(z: float, clip: float, delta: float, mode: str) -> None:
    config = RoundConfig(dp=DPConfig(mode=mode, noise_multiplier=z, clip=clip, delta=delta))  # type: ignore[arg-type]
    assert RoundConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("noise_multiplier", -0.5),
        ("noise_multiplier", float("nan")),
        ("noise_multiplier", float("inf")),
        ("noise_multiplier", 1e300),
        ("noise_multiplier", 1e-300),
        ("noise_multiplier", "1.0"),
        ("noise_multiplier", True),
        ("clip", 0.0),
        ("clip", -1.0),
        ("clip", float("inf")),
        ("clip", None),
        ("delta", 0.0),
        ("delta", 0.5),
        ("delta", -1e-5),
        ("delta", float("nan")),
        ("max_epsilon", -1.0),
        ("max_epsilon", 0.0),
        ("max_epsilon", float("inf")),
        ("bitwidth", 70),
        ("bitwidth", 7),
        ("bitwidth", 32.0),
        ("bitwidth", "32"),
        ("weighting", "weighted"),
        ("sampling_probability", 0.0),
        ("sampling_probability", 1.5),
        ("sampling_probability", 1e-300),
        ("sampling_probability", 9e-7),
        ("delta", 5e-324),
        ("delta", 1e-31),
        ("target_quantile", 1.0),
        ("clip_learning_rate", 0.0),
        ("mechanism", "laplace"),
        ("accountant", "moments"),
        ("mode", "local"),
    ],
)
def test_out_of_range_dp_field_is_refused_by_name(field: str, value: object) -> None:
    dp = {"mode": "central", "noise_multiplier": 1.0, "clip": 1.0, field: value}
    with pytest.raises(ValueError, match=rf"dp\.{field}"):
        RoundConfig.from_dict({"dp": dp})


def test_distributed_dp_refuses_central_only_settings() -> None:
    with pytest.raises(ValueError, match="target_quantile"):
        RoundConfig.from_dict(
            {"dp": {"mode": "distributed", "noise_multiplier": 1.0, "clip": 1.0, "target_quantile": 0.5}}
        )
    with pytest.raises(ValueError, match="clipped_count_stddev"):
        DPConfig(mode="central", noise_multiplier=1.0, clip=1.0, clipped_count_stddev=2.0)


def test_a_sampled_task_with_a_noise_multiplier_its_accountant_cannot_afford_is_refused_by_name() -> None:
    low = MIN_SAMPLED_NOISE_MULTIPLIER / 2
    with pytest.raises(ValueError, match=r"dp\.noise_multiplier .* dp\.sampling_probability"):
        RoundConfig.from_dict(
            {"dp": {"mode": "central", "noise_multiplier": low, "clip": 1.0, "sampling_probability": 0.1}}
        )
    # without sampling (or at probability 1, the same) the closed form costs nothing: taken
    assert DPConfig(mode="central", noise_multiplier=low, clip=1.0, sampling_probability=1.0).noise_multiplier == low
    assert DPConfig(mode="central", noise_multiplier=0.0, clip=1.0, sampling_probability=0.1).noise_multiplier == 0.0


_ANY = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 2**70),
    st.text(max_size=5),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
_FIELDS = [
    "mode",
    "noise_multiplier",
    "clip",
    "delta",
    "max_epsilon",
    "weighting",
    "target_quantile",
    "clip_learning_rate",
    "clipped_count_stddev",
    "mechanism",
    "bitwidth",
    "sampling_probability",
    "accountant",
]


@settings(deadline=None)
@given(values=st.dictionaries(st.sampled_from(_FIELDS), _ANY, max_size=4))
def test_any_dp_setting_is_taken_or_refused_as_a_value_error_naming_dp(values: dict[str, object]) -> None:
    """Whatever a task's dp holds, the config either validates or is a ValueError naming ``dp``
    (the deploy's 400 BAD_CONFIG), never another exception."""
    data = {"mode": "central", "noise_multiplier": 1.0, "clip": 1.0, **values}
    try:
        config = RoundConfig.from_dict({"dp": data})
    except ValueError as exc:
        assert "dp" in str(exc)
        return
    assert config.dp is not None and RoundConfig.from_dict(config.to_dict()) == config


def test_a_delta_or_sampling_probability_too_small_to_be_meant_is_refused_with_its_range() -> None:
    """At 5e-324 the accountant still reports an epsilon, and at a sampling probability of 1e-300
    an epsilon of 0: neither is a setting anyone means."""
    for field, value, range_ in [("delta", 5e-324, "1e-30 to 0.1"), ("sampling_probability", 1e-300, "1e-06 to 1")]:
        dp = {"mode": "central", "noise_multiplier": 1.0, "clip": 1.0, field: value}
        with pytest.raises(ValueError, match=rf"dp\.{field} {value:g} is below .* use {range_}"):
            RoundConfig.from_dict({"dp": dp})
    edge = DPConfig(mode="central", noise_multiplier=1.0, clip=1.0, delta=1e-30, sampling_probability=1e-6)
    assert (edge.delta, edge.sampling_probability) == (1e-30, 1e-6)
