"""What attention layers need to know about the batch in one forward pass."""
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class ForwardContext:
    """Flat batch of T query tokens from S sequences (see kernels/attention.py for the layout).

    slot_mapping:    [T] int64, cache slot of each new token (-1 = padding)
    block_tables:    [S, max_blocks] int32
    seq_lens:        [S] int32, context length after this step
    query_start_loc: [S+1] int32
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Every sequence with more than one new token starts at position 0 (fresh prefills): their
    # keys and values are all in this step's k and v, which attention may read directly.
    prefills_from_start: bool = False
    # Called after layer i stored its KV (the KV connector's layer-wise push in write mode).
    on_layer_stored: Callable[[int], None] | None = None
