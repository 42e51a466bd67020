"""Where a batch's rows are, for the methods that split a batch into micro-batches (micro_batch,
pipeline_parallel and mixed_parallel's pipeline, ds_3d_parallel).

They take each input's rows on its first dimension. A data pipeline that stacks the rows on another
dimension of an input (a sequence-first layout, ``(seq, batch)``: ``nn.Transformer``'s default
``batch_first=False`` and its language-modelling tutorial's batches) would have its sequence split
instead: every micro-batch attending over a part of each sequence, the losses and the gradients silently
not one process's. ``check_rows_first`` reads where the rows go from the data pipeline itself (one
dataset row collated once and twice, then prepared: ``ModelContext.row_stacking``), not from shapes
that may coincide, and refuses such a batch by name when the method is applied. The inputs it stacks no
rows into are taken whole by every micro-batch, even where their first dimension equals the rows.
"""
from __future__ import annotations

from atorch.errors import MethodConfigError


def rows_elsewhere(ctx) -> str:
    """Why micro-batches cannot split this data pipeline's batches ("" where they can): the search leaves
    out the candidates ``check_rows_first`` would refuse."""
    try:
        check_rows_first(ctx, "micro-batches")
    except MethodConfigError as error:
        return str(error).removeprefix("micro-batches: ").split(": a sequence-first")[0]
    return ""


def check_rows_first(ctx, method: str) -> frozenset[str]:
    """MethodConfigError naming the input whose rows the data pipeline stacks on a dimension other than
    the first. Returns the paths (``pytree.keystr``) of the inputs it stacks no rows into (an input the
    rows share), which micro-batches take whole whatever their shape; none without a dataset, or where the
    collate does not stack rows one by one."""
    layout = ctx.row_stacking() or []
    elsewhere = [(path, shape, dim) for path, shape, dim in layout if dim not in (None, 0)]
    if not elsewhere:
        return frozenset(path for path, _, dim in layout if dim is None)
    path, shape, dim = elsewhere[0]
    raise MethodConfigError(
        method, f"micro-batches take each input's rows on its first dimension, but the data pipeline (collate_fn, "
        f"then prepare_input) stacks the rows of the input at {path or 'the batch'} on dimension {dim} (shape "
        f"{list(shape)} for 2 rows): a sequence-first layout (nn.Transformer's default batch_first=False) would have "
        "its sequence split, every micro-batch attending over a part of it, silently. Stack the rows first (the "
        "collate stacking on dimension 0 and the model built with batch_first=True), or train without "
        "micro-batches: data parallelism shards a batch by its rows")
