"""The search report: one row per candidate, as a table (text and CSV) and a time-vs-memory plot.

The table is always logged and kept in the search result (``result.args.extras["search"].table``);
files are written only when the user names a ``report_dir``, so a training script run from a
source checkout does not leave reports behind in whatever directory it was started from.
"""
from __future__ import annotations

import csv
import logging
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from atorch.utils.plotting import headless_pyplot

logger = logging.getLogger(__name__)

MIB = 2**20


@dataclass
class Row:
    label: str
    predicted_memory: int
    predicted_time_s: float
    status: str = "not tried"        # ok / failed / over memory limit / predicted over limit / skipped: time limit
    measured_memory: Optional[int] = None
    measured_time_s: Optional[float] = None
    reason: str = ""
    chosen: bool = False
    samples: list = field(default_factory=list)  # every measured step time (confirmation rounds add more)
    spread_s: float = 0.0  # the largest standard deviation of one dry run's timed steps (the noise)
    # False for a refine try (the chosen candidate plus a compute method): the cost model does not price
    # compute methods, so its predicted time is its base candidate's, not a prediction of its own
    priced: bool = True

    @property
    def memory_error(self) -> Optional[float]:
        if not self.measured_memory:
            return None
        return (self.predicted_memory - self.measured_memory) / self.measured_memory


def rank_correlation(rows: list[Row]) -> Optional[tuple[float, int]]:
    """Spearman's rank correlation between the predicted and the measured step times of the rows
    that were dry-run (ties share their average rank), and how many there were; None under three:
    how far the predictions that pick the dry runs can be trusted to order them. Refine tries are left
    out (``Row.priced``): their predicted time is their base's, so a pair of them would only compare a
    method's measured effect, and the noise, with a tie the cost model never predicted."""
    return spearman([(row.predicted_time_s, row.measured_time_s) for row in rows if row.measured_time_s and row.priced])


def spearman(pairs: list[tuple[float, float]]) -> Optional[tuple[float, int]]:
    """Spearman's rank correlation of (predicted, measured) pairs (ties share their average rank) and
    how many pairs there were; None under three."""
    if len(pairs) < 3:
        return None
    predicted, measured = _ranks([p for p, _ in pairs]), _ranks([m for _, m in pairs])
    try:
        return statistics.correlation(predicted, measured), len(pairs)  # Pearson's of the ranks: Spearman's
    except statistics.StatisticsError:  # every prediction (or measurement) the same: no order to compare
        return 0.0, len(pairs)


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2
        start = end + 1
    return ranks


def format_table(rows: list[Row], memory_limit: int) -> str:
    header = (f"{'':2}{'candidate':<40}{'pred MiB':>10}{'meas MiB':>10}{'err':>7}"
              f"{'pred ms':>10}{'meas ms':>10}  status")
    lines = [f"memory limit per rank: {memory_limit / MIB:.1f} MiB", header, "-" * (len(header) + 20)]
    for row in rows:
        measured_mem = f"{row.measured_memory / MIB:>10.1f}" if row.measured_memory else f"{'':>10}"
        error = f"{row.memory_error * 100:>6.1f}%" if row.memory_error is not None else f"{'':>7}"
        measured_time = f"{row.measured_time_s * 1000:>10.1f}" if row.measured_time_s else f"{'':>10}"
        status = row.status + (f" ({row.reason})" if row.reason else "")
        predicted = math.isfinite(row.predicted_time_s)  # not: failed alone, or never measured
        predicted_mem = f"{row.predicted_memory / MIB:>10.1f}" if predicted else f"{'':>10}"
        predicted_time = f"{row.predicted_time_s * 1000:>10.1f}" if predicted else f"{'':>10}"
        lines.append(f"{'*' if row.chosen else ' ':2}{row.label:<40}{predicted_mem}{measured_mem}"
                     f"{error}{predicted_time}{measured_time}  {status}")
    correlation = rank_correlation(rows)
    lines.append("predicted vs measured step time: " + (
        f"Spearman rank correlation {correlation[0]:.2f} over {correlation[1]} dry-run candidates" if correlation
        else "fewer than 3 dry-run candidates, no rank correlation")
        + (" (refine tries left out: the cost model does not price their methods)"
           if any(row.measured_time_s and not row.priced for row in rows) else ""))
    return "\n".join(lines)


def write_report(rows: list[Row], memory_limit: int, directory: str) -> list[Path]:
    """search_report.txt, search_report.csv and, with matplotlib, search_report.png."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "search_report.txt", out / "search_report.csv"]
    written[0].write_text(format_table(rows, memory_limit) + "\n")
    with written[1].open("w", newline="") as handle:
        fields = list(asdict(rows[0])) + ["memory_error"]
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({**asdict(row), "memory_error": row.memory_error})
    plot = _plot(rows, memory_limit, out / "search_report.png")
    if plot:
        written.append(plot)
    return written


def _plot(rows: list[Row], memory_limit: int, path: Path) -> Optional[Path]:
    plt = headless_pyplot("plot in the search report")
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for row in rows:
        mem = (row.measured_memory or row.predicted_memory) / MIB
        t = (row.measured_time_s or row.predicted_time_s) * 1000
        marker = "*" if row.chosen else ("o" if row.measured_time_s else "x")
        ax.scatter(mem, t, marker=marker, s=120 if row.chosen else 30)
        ax.annotate(row.label, (mem, t), fontsize=6)
    ax.axvline(memory_limit / MIB, linestyle="--", color="grey")
    ax.set_xlabel("peak memory per rank (MiB): measured (o) or predicted (x)")
    ax.set_ylabel("step time (ms)")
    ax.set_title("atorch strategy search")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
