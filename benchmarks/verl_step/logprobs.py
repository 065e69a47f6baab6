"""The bench's chunked log-probs in verl's FSDP engine."""

from __future__ import annotations

LOGPROB_ROWS = 2048  # rows per log_softmax in the chunked log-probs (verl's entropy chunk size)


def _logprobs_chunked(logits, labels, inplace_backward: bool = True):
    """The bench's stand-in for ``verl.utils.torch_functional.logprobs_from_logits`` in verl's FSDP
    engine, for every strategy alike: ``log_softmax`` over ``LOGPROB_ROWS`` rows at a time, then each
    row's label entry. ``logits``: (N, vocab) or (..., vocab); ``labels``: the leading shape, int64;
    returns the log-probs in ``labels``' shape and ``logits``' dtype.

    Why: without flash-attn's cross-entropy kernel (not installed here, and turned off by verl's
    ``full_determinism``, ``VERL_DISABLE_FLASH_ATTN_CE=1``) verl falls back to
    ``logprobs_from_logits_v2``, which runs one ``log_softmax`` per token in a Python loop. Measured on
    one H200 (a compute-rich update_actor of Qwen2.5-1.5B, resident, torch 2.11): 472,510 kernels a step,
    3.2 s of kernel time against 13.3 s of wall under the profiler, host-bound, and step times spread by
    2-4 s, more than the transfers this bench measures. Same maths per row (``log_softmax`` over the
    vocabulary, deterministic); a verl user with flash-attn installed gets one fused kernel instead.
    (The kernel counts are from a profiler probe whose output is not kept; the spread is the f70690e
    run, ``benchmarks/results/verl_step_qwen2.5-1.5b_fsdp2-full-compute-rich_h200x1_2026-12-02.json``.)

    Raises:
        ValueError: ``labels`` does not name one entry per row of ``logits``.
    """
    import torch

    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels of shape {tuple(labels.shape)} for logits of shape {tuple(logits.shape)}: "
                         "one label per row of logits expected")
    rows = logits.reshape(-1, logits.shape[-1])
    index = labels.reshape(-1, 1)
    out = [torch.log_softmax(rows[i:i + LOGPROB_ROWS], dim=-1).gather(-1, index[i:i + LOGPROB_ROWS]).squeeze(-1)
           for i in range(0, rows.shape[0], LOGPROB_ROWS)]
    return (torch.cat(out) if out else rows.new_empty(0)).view(labels.shape)
