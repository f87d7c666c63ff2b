"""The optimizer's mechanisms that the step uses (optimizer.py), apart from a task."""

from __future__ import annotations

import torch

from {{ cookiecutter.package_name }}.training.optimizer import clear_gradients


def _parameters_with_gradients(count: int) -> list[torch.nn.Parameter]:
    parameters = [torch.nn.Parameter(torch.ones(2)) for _ in range(count)]
    for parameter in parameters:
        parameter.grad = torch.ones(2)
    return parameters


def test_clear_gradients_drops_the_gradients_of_every_group_as_zero_grad_does() -> None:
    first, second, left_out = _parameters_with_gradients(3)
    optimizer = torch.optim.SGD([{"params": [first]}, {"params": [second], "lr": 0.5}], lr=0.1)
    clear_gradients(optimizer)
    assert first.grad is None and second.grad is None
    assert torch.equal(left_out.grad, torch.ones(2))  # not the optimizer's: not its to clear


def test_clear_gradients_calls_an_optimizer_s_own_zero_grad() -> None:
    """A zero_grad of the optimizer's class, or set on the optimizer, may do more than drop
    the gradients (clear buffers of its own): it is called, with set_to_none=True."""
    calls = []

    class Own(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            calls.append(set_to_none)

    (parameter,) = _parameters_with_gradients(1)
    clear_gradients(Own([parameter], lr=0.1))
    patched = torch.optim.SGD([parameter], lr=0.1)
    patched.zero_grad = lambda set_to_none=True: calls.append(("patched", set_to_none))
    clear_gradients(patched)
    assert calls == [True, ("patched", True)]
    assert torch.equal(parameter.grad, torch.ones(2))
