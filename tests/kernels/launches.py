"""Counting a Triton kernel's launches in a test (CPU interpreter and GPU): that a path was taken."""


def record_launches(monkeypatch, module, name: str) -> list:
    """Wrap `module.<name>` (a Triton kernel, launched as kernel[grid](...)) so that each launch
    appends its grid to the returned list and then runs the kernel."""
    launched, real = [], getattr(module, name)

    class Recorded:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(module, name, Recorded())
    return launched
