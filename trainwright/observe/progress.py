"""The console progress bar shown by rank 0: step, loss, samples/s."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

__all__ = ["StepProgress"]


class StepProgress:
    """A rich progress bar over training steps (plain lines when stderr is not a terminal).

    Args:
        total: last step of the run.
        done: steps already completed (after a resume).
    """

    def __init__(self, total: int, done: int = 0):
        console = Console(file=sys.stderr)
        self._plain = not console.is_terminal
        self._console, self._total, self._last_print = console, total, done
        self._bar = None
        if not self._plain:
            self._bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[eval]}"),
                TextColumn("{task.fields[rate]} samples/s"),
                TimeRemainingColumn(), console=console, transient=False)
            self._task = self._bar.add_task("train", total=total, completed=done, loss="-",
                                            rate="-", eval="")
            self._bar.start()

    def update(self, step: int, loss: float | None, samples_per_s: float) -> None:
        """Show that ``step`` finished with ``loss`` at ``samples_per_s``."""
        text = "-" if loss is None else f"{loss:.4f}"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=text, rate=f"{samples_per_s:.1f}")
        elif step == self._total or step - self._last_print >= max(1, self._total // 10):
            self._last_print = step
            self._console.print(f"step {step}/{self._total}  loss {text}  "
                                f"{samples_per_s:.1f} samples/s", highlight=False)

    def show_eval(self, loss: float, perplexity: float | None = None) -> None:
        """Show the latest held-out loss (and perplexity) next to the training loss."""
        text = f"eval {loss:.4f}" + (f" ppl {perplexity:.2f}" if perplexity is not None else "")
        if self._bar is not None:
            self._bar.update(self._task, eval=text)
        else:
            self._console.print(text, highlight=False)

    def close(self) -> None:
        """Stop redrawing."""
        if self._bar is not None:
            self._bar.stop()
