"""A task's DP settings travel in its RoundConfig, and out-of-range ones are refused by name."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server_stub import DPConfig, RoundConfig


@given(
    z=st.floats(0.0, 100.0),
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
        ("clip", 0.0),
        ("delta", 0.0),
        ("delta", 0.5),
        ("max_epsilon", -1.0),
        ("bitwidth", 70),
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
