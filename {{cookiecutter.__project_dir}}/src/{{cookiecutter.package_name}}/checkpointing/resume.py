"""Whether a checkpoint can continue this run, and what changed since it was written.

A resumed run is never silently different from what its config says. Each setting that differs
from the checkpoint's is either refused (it would change what the checkpoint means: the data
order, the model, the position in the data) or applied from the resumed step on, and then said in
one log line. A different number of ranks is allowed: the position in the data does not depend
on it, only the per-rank random streams do, which are then derived afresh.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..config import flatten
from .layout import complete_checkpoints, set_aside_checkpoints

log = logging.getLogger(__name__)

#: Settings whose change is refused on resume, with why.
REFUSED = {
    "run.seed": "it chooses the initial weights and the order of the data",
    "train.global_batch_size": "the position in the data is counted in global batches",
    "task.": "the model and the data would no longer be those the checkpoint was trained on",
}
#: What applying a changed setting means, where there is more to say than "from now on".
APPLIED = {
    "optim.lr": "the schedule's peak in every optimizer group that sets no lr of its own",
    "optim.weight_decay": "in every optimizer group that sets none of its own",
    "optim.betas": "in every optimizer group that sets none of its own",
    "optim.warmup_steps": "the learning-rate schedule takes its new shape at the current step",
    "optim.min_lr_ratio": "the learning-rate schedule takes its new shape at the current step",
    "train.max_steps": "the learning-rate schedule now ends at the new last step",
    "train.epochs": "the learning-rate schedule now ends at the new last step",
    "train.micro_batch_size": "same global batch, other micro-batches: results differ in the "
    "last bits",
    "train.mixed_precision": "the loss scaler starts afresh when fp16 is turned on",
}
#: What applying a changed optim.* setting means when the task builds its own optimizer or
#: schedule (contract.py: build_optimizer, build_scheduler).
OWN_OPTIMIZER_NOTE = (
    "given to the task's build_optimizer and build_scheduler; each optimizer group that "
    "changes with it is logged"
)
#: Settings that change where, whether or from what a run starts, not the run itself.
NOT_COMPARED = {
    "run.dir",
    "run.local_dir",
    "checkpoint.resume",
    "checkpoint.start_over_if_unusable",
    "init.weights",
}


class ResumeError(RuntimeError):
    """The checkpoint in the run directory cannot continue this run as configured."""


def require_fresh_run_dir(run_dir: Path) -> None:
    """Refuse to start a new run where an earlier run's checkpoints are (checkpoint.resume=false).

    Starting over there would mix two runs' metrics and prune one run's checkpoints by the
    other's names, and a later launch would resume whichever checkpoint is newest.
    """
    checkpoints = complete_checkpoints(run_dir) + set_aside_checkpoints(run_dir)
    if checkpoints:
        names = ", ".join(path.name for path in checkpoints)
        raise ResumeError(
            f"checkpoint.resume=false, but {run_dir} holds checkpoints of an earlier run "
            f"({names}). Use a new run.dir for a new run, or drop "
            "checkpoint.resume=false to continue that one."
        )


def changed_settings(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple]:
    """`section.key` -> (checkpoint's value, current value) for every setting that differs.

    Settings that exist on one side only (a config written by another version) are skipped.
    """
    old, new = flatten(saved), flatten(current)
    return {
        key: (old[key], new[key])
        for key in old.keys() & new.keys()
        if key not in NOT_COMPARED and old[key] != new[key]
    }


def check_changes(
    changes: dict[str, tuple], path: Path, announce: bool, own_optimizer: bool = False
) -> None:
    """Raise ResumeError for refused changes; otherwise log one line per applied change.

    With `own_optimizer` (the task builds its optimizer or schedule), what an optim.* setting
    does is the task's: the line says so, and the groups that change are logged apart."""
    refused = {key: values for key, values in changes.items() if _refusal(key)}
    if refused:
        details = "; ".join(
            f"{key} {old!r} -> {new!r} ({_refusal(key)})" for key, (old, new) in refused.items()
        )
        raise ResumeError(
            f"cannot resume {path} with changed settings: {details}. Set them back to the "
            "checkpoint's values, or start a new run with another run.dir."
        )
    if announce:
        for key, (old, new) in sorted(changes.items()):
            note = APPLIED.get(key, "used from now on")
            if own_optimizer and key.startswith("optim.") and key != "optim.grad_clip":
                note = OWN_OPTIMIZER_NOTE
            log.info("%s changed from %r to %r: applied (%s)", key, old, new, note)


def announce_world_size_change(saved: int, current: int, announce: bool) -> None:
    if announce:
        log.warning(
            "resuming a checkpoint of %d ranks on %d: the data continues at the exact sample and "
            "the global batch is unchanged, but each rank's random numbers (dropout, "
            "augmentation) are derived afresh, so this run is no longer bitwise reproducible",
            saved,
            current,
        )


def continue_sample_seeds(saved: bool | None, now: bool, step: int, announce: bool) -> bool:
    """Whether the data's random draws go on being seeded per sample (data.py) after a resume
    at `step`: as the run did so far (`saved`; None in checkpoints of before it was recorded),
    whatever the loader workers of this launch (`now`), so that a relaunch with other worker
    counts draws what the unbroken run would. Workers cannot draw from a rank's streams: a run
    that did so and now has workers is seeded per sample from here on, and says so."""
    if saved is None or saved == now:
        return now
    if saved:
        if announce:
            log.info(
                "the data's random draws are seeded per sample, as this run's earlier launches "
                "did in loader workers: without workers now, in the training process"
            )
        return True
    if announce:
        log.warning(
            "this run drew its data's random numbers from each rank's stream (no loader "
            "workers); the workers of this launch seed them per sample instead: the samples and "
            "their order are unchanged, random augmentation differs from an unbroken run after "
            "step %d",
            step,
        )
    return True


def _refusal(key: str) -> str | None:
    for prefix, reason in REFUSED.items():
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
            return reason
    return None
