"""The labels of the DFlash objective for a padded batch (one row per sequence): what the packed layout's
`packed_batches.packed_block_labels` must agree with (test_packed_layout.py); checked itself against a plain loop
(test_train_data.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from dflash.stage2_train.loss import IGNORE_INDEX


def block_labels(input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, anchor_valid: Tensor, lengths: Tensor,
                 block_size: int, mask_token_id: int) -> tuple[Tensor, Tensor]:
    """Labels and block inputs of the DFlash objective for a padded batch.

    input_ids, loss_mask: [B, S]; anchors, anchor_valid: [B, A]; lengths: [B].
    Returns labels [B, A, Bk] long: input_ids[p + k] where k >= 1, p + k < length and loss_mask[p + k], else -100
    (offset 0 and invalid anchors are never labels); block_input_ids [B, A, Bk] long: [input_ids[p], MASK, ...]
    for a valid anchor, all MASK for an invalid one."""
    batch, seq = input_ids.shape
    num_anchors = anchors.shape[1]
    device = input_ids.device
    offsets = torch.arange(block_size, device=device)
    positions = anchors.long()[:, :, None] + offsets  # [B, A, Bk]
    inside = (positions < lengths.long()[:, None, None]) & (positions < seq) & (positions >= 0)
    gather_at = positions.clamp(0, max(seq - 1, 0)).reshape(batch, num_anchors * block_size)
    tokens = input_ids.long().gather(1, gather_at).view(batch, num_anchors, block_size)
    supervised = loss_mask.bool().gather(1, gather_at).view(batch, num_anchors, block_size)
    keep = supervised & inside & anchor_valid.bool()[:, :, None] & (offsets >= 1)
    labels = torch.where(keep, tokens, torch.full_like(tokens, IGNORE_INDEX))
    block_input_ids = torch.full_like(tokens, int(mask_token_id))
    block_input_ids[:, :, 0] = torch.where(anchor_valid.bool() & inside[:, :, 0], tokens[:, :, 0],
                                           torch.full_like(tokens[:, :, 0], int(mask_token_id)))
    return labels, block_input_ids
