"""Console progress bars: training steps (step, loss, samples/s, tokens/s, MFU) and a
benchmark's runs."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

__all__ = ["RunProgress", "StepProgress", "rate_text"]


def rate_text(samples_per_s: float, tokens_per_s: float | None = None,
              mfu: float | None = None) -> str:
    """``"204.1 samples/s  13,062 tokens/s  MFU 41.2%"`` (the parts that are known)."""
    parts = [f"{samples_per_s:.1f} samples/s"]
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:,.0f} tokens/s")
    if mfu is not None:
        parts.append(f"MFU {100 * mfu:.1f}%")
    return "  ".join(parts)


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
                TextColumn("{task.fields[rate]}"),
                TimeRemainingColumn(), console=console, transient=False)
            self._task = self._bar.add_task("train", total=total, completed=done, loss="-",
                                            rate="- samples/s", eval="")
            self._bar.start()

    def update(self, step: int, loss: float | None, samples_per_s: float,
               tokens_per_s: float | None = None, mfu: float | None = None) -> None:
        """Show that ``step`` finished with ``loss`` at ``samples_per_s`` (and
        ``tokens_per_s`` and ``mfu`` where known)."""
        text = "-" if loss is None else f"{loss:.4f}"
        rate = rate_text(samples_per_s, tokens_per_s, mfu)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=text, rate=rate)
        elif step == self._total or step - self._last_print >= max(1, self._total // 10):
            self._last_print = step
            self._console.print(f"step {step}/{self._total}  loss {text}  {rate}",
                                highlight=False)

    def show_eval(self, loss: float, perplexity: float | None = None) -> None:
        """Show the latest held-out loss (and perplexity) next to the training loss."""
        text = f"eval {loss:.4f}" + (f" ppl {perplexity:.2f}" if perplexity is not None else "")
        if self._bar is not None:
            self._bar.update(self._task, eval=text)
        else:
            self._console.print(text, highlight=False)

    def close(self, loss: float | None = None, eval_loss: float | None = None,
              where: object = None) -> None:
        """Stop redrawing; with ``loss``, end on ``final loss 3.1842 (eval 3.3010) -> WHERE``
        (the report, or the run directory)."""
        if self._bar is not None:
            self._bar.stop()
        if loss is None and where is None:
            return
        text = "final loss " + ("-" if loss is None else f"{loss:.4f}")
        if eval_loss is not None:
            text += f" (eval {eval_loss:.4f})"
        if where is not None:
            text += f"  -> {where}"
        self._console.print(text, highlight=False, soft_wrap=True)


class RunProgress:
    """A rich progress bar over a benchmark's runs, showing the last one's result (one plain
    line per run when stderr is not a terminal, e.g. a log file).

    Args:
        title: what runs, e.g. ``"bench pipeline"``.
        total: number of runs.
    """

    def __init__(self, title: str, total: int):
        self._console, self._title, self._total = Console(file=sys.stderr), title, total
        self._bar = None
        if self._console.is_terminal:
            self._bar = Progress(
                TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(),
                TimeRemainingColumn(), TextColumn("{task.fields[last]}"),
                console=self._console, transient=False)
            self._task = self._bar.add_task(title, total=total, last="")
            self._bar.start()

    def update(self, done: int, text: str) -> None:
        """Show that ``done`` runs have finished, the last with result ``text``."""
        if self._bar is not None:
            self._bar.update(self._task, completed=done, last=text)
        else:
            self._console.print(f"{self._title}: {done}/{self._total} {text}", highlight=False,
                                soft_wrap=True)

    def close(self) -> None:
        """Stop redrawing."""
        if self._bar is not None:
            self._bar.stop()

