"""The doctor's verdicts on what it measured (the checks themselves run on two hosts in the
template's tests/test_multinode.py, where their numbers depend on the machine's load)."""

from __future__ import annotations

import pytest
import torch

from {{ cookiecutter.package_name }} import doctor
from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv
from {{ cookiecutter.package_name }}.config import Config

pytestmark = pytest.mark.standalone


def _compute_check(
    monkeypatch: pytest.MonkeyPatch, config: Config, per_rank: list[float]
) -> doctor.Check:
    """The compute check, as if the ranks had measured `per_rank` TFLOP/s."""
    monkeypatch.setattr(doctor, "gather_objects", lambda mine: per_rank)
    return doctor._compute(config, DistEnv(), torch.device("cpu"))


def test_a_rank_below_80_percent_of_the_fastest_is_named_as_slow(
    monkeypatch: pytest.MonkeyPatch, fast_config: Config
) -> None:
    check = _compute_check(monkeypatch, fast_config, [1.0, 0.7, 0.95])
    assert check.verdict == doctor.WARN
    assert check.value.startswith("rank 1 on an unknown host below 80% of the fastest")


def test_ranks_within_80_percent_of_the_fastest_pass(
    monkeypatch: pytest.MonkeyPatch, fast_config: Config
) -> None:
    check = _compute_check(monkeypatch, fast_config, [1.0, 0.85])
    assert check.verdict == doctor.PASS
    assert check.value.startswith("0.85-1 TFLOP/s per rank")
