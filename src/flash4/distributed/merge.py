"""Exact merge of partial attention results by their log-sum-exp.

Attention of a query row over the union of two disjoint key sets A and B, from each set's own
(out, lse) with lse = log sum_j exp(s_j) over that set:

    lse   = log(exp(lse_A) + exp(lse_B))                      (torch.logaddexp)
    out   = exp(lse_A - lse) * out_A + exp(lse_B - lse) * out_B
          = sigmoid(lse_A - lse_B) * out_A + sigmoid(lse_B - lse_A) * out_B

The weights are taken in the sigmoid form: lse_B - lse_A of two nearby fp32 numbers is exact,
whereas lse_A - lse carries the rounding of lse (an ulp of lse = 1e4 is 1e-3: the exp form would
be off by 1e-3 relative there). A set the row sees nothing of has out 0 and lse -inf (flash4's
convention), so its weight is 0; a row that sees nothing in either set keeps out 0 and lse -inf
(both weights 0 there, where -inf - -inf would give NaN). Computed in fp32 (or the inputs' wider
dtype).
"""

from __future__ import annotations

import torch


def weights(lse, block_lse):
    """(w_old, w_new, new_lse): the merge's weights of the accumulated and the block's out, each
    (rows, nheads, 1), and the merged lse (nheads, rows), in lse's dtype (module docstring)."""
    block_lse = block_lse.to(lse.dtype)
    empty = torch.isneginf(lse) & torch.isneginf(block_lse)
    diff = torch.where(empty, torch.zeros_like(lse), block_lse - lse)  # +-inf when one side is empty
    keep = (~empty).to(lse.dtype)
    w_old = (torch.sigmoid(-diff) * keep).T.unsqueeze(-1)
    w_new = (torch.sigmoid(diff) * keep).T.unsqueeze(-1)
    return w_old, w_new, torch.logaddexp(lse, block_lse)


def merge(out, lse, block_out, block_lse):
    """(out, lse) of the union of two disjoint key sets (module docstring).
    out, block_out: (rows, nheads, headdim); lse, block_lse: (nheads, rows) (flash4's varlen
    layout). out / lse are the running accumulators (fp32 or wider); block_* any float dtype.
    Returns new tensors (out in out's dtype, lse in lse's)."""
    w_old, w_new, new_lse = weights(lse, block_lse)
    return w_old * out + w_new * block_out.to(out.dtype), new_lse


def merge_rows(out, lse, rows, block_out, block_lse) -> None:
    """merge() into the accumulators in place, for the query rows `rows` only: None (all rows:
    no temporary the size of out but the block's cast) or an int64 index tensor (rows,) that
    block_out / block_lse's rows correspond to."""
    if rows is None:
        w_old, w_new, new_lse = weights(lse, block_lse)
        out.mul_(w_old).addcmul_(block_out.to(out.dtype), w_new)
        lse.copy_(new_lse)
        return
    new_out, new_lse = merge(out.index_select(0, rows), lse.index_select(1, rows), block_out, block_lse)
    out.index_copy_(0, rows, new_out)
    lse.index_copy_(1, rows, new_lse)
