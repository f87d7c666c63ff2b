"""The non-finite guard's record, as the trainer reads it at a log line: the first step whose
loss or gradient norm was not finite, whatever the steps kept aside before it held; and a step
that fp16's loss scaler skips leaves the buffers as they were."""

from __future__ import annotations

import math

import torch

from {{ cookiecutter.package_name }}.training.divergence import DivergenceGuard, SkipPolicy

CPU = torch.device("cpu")
NAN = math.nan


def losses(*values: float, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.tensor(value, dtype=dtype) for value in values]


def test_the_first_step_with_a_non_finite_micro_batch_loss_is_recorded() -> None:
    guard = DivergenceGuard(CPU)
    guard.end_step(1, losses(1.0, 2.0), torch.tensor(0.5))
    guard.end_step(2, losses(1.0, NAN), torch.tensor(0.5))
    guard.end_step(3, losses(math.inf, 1.0), torch.tensor(0.5))
    assert guard.record().tolist() == [2.0, 0.0, 0.0, 0.0]


def test_losses_of_other_dtypes_and_counts_are_checked_alike() -> None:
    """bf16 losses, then fp32 ones, then a step with one loss less (an update skipped in a
    task with several): the step and the field are still those of the first non-finite value,
    and large finite losses are not taken for an overflow."""
    guard = DivergenceGuard(CPU)
    guard.end_step(1, losses(6e4, 6e4, dtype=torch.float16), torch.tensor(0.5))
    guard.end_step(2, losses(1.0, 2.0, dtype=torch.bfloat16), torch.tensor(0.5))
    guard.end_step(3, losses(1.0, 2.0), torch.tensor(0.5))
    guard.end_step(4, losses(1.0), torch.tensor(math.inf))
    guard.end_step(5, losses(NAN, dtype=torch.bfloat16), torch.tensor(0.5))
    assert guard.record().tolist() == [5.0, 4.0, 0.0, 0.0]


def test_a_skipped_step_is_not_recorded_and_the_steps_after_it_are() -> None:
    guard = DivergenceGuard(CPU)
    guard.end_step(1, losses(1.0), torch.tensor(0.5))
    guard.end_step(2, losses(NAN), torch.tensor(NAN), skipped=True)
    guard.end_step(3, losses(1.0), None)  # no norm computed: only the loss is watched
    guard.end_step(4, losses(1.0), torch.tensor(NAN))
    assert guard.record().tolist() == [0.0, 4.0, 0.0, 0.0]


def test_the_gradients_of_fp16_are_left_to_its_loss_scaler() -> None:
    guard = DivergenceGuard(CPU, watch_gradients=False)
    guard.end_step(1, losses(1.0), torch.tensor(math.inf))
    assert guard.record().tolist() == [0.0, 0.0, 0.0, 0.0]


def test_the_steps_kept_aside_are_bounded() -> None:
    """Past PENDING_STEPS the kept values are checked and let go; the record is the same."""
    guard = DivergenceGuard(CPU)
    guard.PENDING_STEPS = 3
    for step in range(1, 11):
        guard.end_step(step, losses(NAN if step == 7 else 1.0), torch.tensor(0.5))
        assert len(guard._norms) <= 3
    assert guard.record().tolist() == [7.0, 0.0, 0.0, 0.0]


def _scaled_step(scale_loss_by: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One fp16-style step of a model with BatchNorm under a loss scaler, its loss multiplied
    by `scale_loss_by` (inf: a gradient that overflows, which the scaler skips): the state
    before and after."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    policy = SkipPolicy(enabled=False, limit=0, is_main=True)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    policy.keep_buffers(model, scaler)
    scaler.scale(model(torch.randn(8, 4)).sum() * scale_loss_by).backward()
    scaler.step(optimizer)
    scaler.update()
    policy.after_scaler_step(scaler)
    return before, model.state_dict()


def test_a_step_the_loss_scaler_skips_leaves_the_buffers_as_they_were() -> None:
    """BatchNorm's running statistics and count move in the forward, before fp16's scaler
    finds the overflow: they are put back with the step."""
    before, after = _scaled_step(math.inf)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_a_step_the_loss_scaler_takes_keeps_what_its_forward_did_to_the_buffers() -> None:
    before, after = _scaled_step(1.0)
    assert int(after["1.num_batches_tracked"]) == 1
    assert not torch.equal(before["1.running_mean"], after["1.running_mean"])
