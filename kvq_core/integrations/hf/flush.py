"""When a :class:`~kvq_core.integrations.hf.layer.KVQLayer` packs its exact tokens: plain integer logic, no torch.

A layer stores the tokens [evicted, cumulative) as packed blocks (oldest first, ``block_tokens``
tokens each, covering [evicted, packed_length)) and a full-precision *window* of the most recent
tokens (the window's first token is at position ``base``). New tokens join the window; attention
for the step is computed over packed blocks + window (so the newest tokens are always seen
exactly); *after* that, tokens are packed:

- ``flush="block"`` (the OScaR reference, specs/oscar.md 1.5; token-group codecs): once the
  window holds ``residual`` tokens or more, its first ``residual * (n // residual)`` tokens are
  encoded as one new block. After a prefill of L tokens ``L - L % residual`` are packed and a
  decode step attends with 1..``residual`` exact tokens.
- ``flush="sliding"`` (the OCTOPUS protocol, specs/octopus.md 1.11; per-token codecs): all but
  the last ``residual - 1`` tokens are packed after every step, so every decode query attends to
  exactly its ``residual`` most recent tokens (itself included) exactly. ``stride`` S > 1
  encodes S tokens at once, up to S - 1 of them ahead of need: those stay in the window and are
  read exact until they age out, so attention is unchanged, decoding encodes once per S steps,
  and the cache holds up to S - 1 tokens twice (codes and exact); a cache built without a
  stride takes :func:`default_stride` (8 where there is an exact window). Per-step blocks are
  joined as they come (:func:`join_range`, :func:`kvq_core.tokens.concat_tokens`), keeping
  O(log n) blocks (each over :data:`JOIN_RATIO` times the next). A multi-token step attends its whole window exactly (as a prefill does), so
  its queries see ``residual``..``residual + chunk - 1`` exact tokens; with ``chunks="decode"``
  and the ``"kvq"`` attention function each of them sees what it would decoding one token at a
  time (window tokens ``residual`` or more positions back are read from their codes), so a
  chunked teacher-forced forward equals token-by-token decoding (``kvq eval ppl`` scores this
  way).

``residual=0`` packs everything after each step under both.

Under both policies, adjacent blocks join by the same rule when the layouts allow it
(:func:`kvq_core.tokens.token_granule`: per-token layouts always; token-group layouts such as
OScaR and KIVI keys when the blocks before the last are whole groups, e.g. 128-token flushes
of 32-token key groups), so attention from codes makes O(log n) kernel calls per layer and step,
not one per flushed block.

A crop (:func:`plan_crop`) removes tokens from the end: from the window, then whole blocks; a
cut inside a block keeps its leading tokens when they are whole token groups (any count for a
per-token layout).
"""
from __future__ import annotations

from collections.abc import Sequence

from kvq_core.errors import KVQError

FLUSH_MODES = ("block", "sliding")


def encode_range(flush: str, residual: int, stride: int, window: int, base: int, packed_length: int) -> tuple[int, int]:
    """Window tokens ``[start, stop)`` to encode after a step (``start == stop``: none).

    The window holds ``window`` tokens from position ``base`` (this step's included); positions
    before ``packed_length`` are packed already (a sliding stride packs ahead of ``base``).
    "block": the window's whole multiples of ``residual`` (none until it holds ``residual``);
    "sliding": the unpacked tokens among all but the last ``residual - 1``, and when fewer than
    ``stride``, more up to ``stride`` (as far as the window goes)."""
    start = packed_length - base
    if flush == "sliding":
        need = window - max(residual - 1, 0)
        count = 0 if need <= start else min(window, max(need, start + stride)) - start
    else:
        count = 0 if window < max(residual, 1) else (window if residual == 0 else (window // residual) * residual)
    return start, start + count


def window_drop(flush: str, residual: int, window: int, encoded: int) -> int:
    """Leading window tokens to drop after a step that encoded ``encoded`` of them: a block flush
    drops what it encoded; a sliding flush keeps only the last ``residual - 1`` tokens exact."""
    if flush == "sliding":
        return max(window - max(residual - 1, 0), 0)
    return encoded


#: a settled block stays apart from the (joined) newer tokens after it only while it is more than
#: this many times as long: each block is then over JOIN_RATIO times the next, so a layer holds at
#: most log_R(n) + 1 settled blocks. 1 would be a binary counter (~log2(n) / 2 blocks on average,
#: each an attend call per decode step: 5 at 2k tokens); 16 holds 2-3 and copies each token's
#: codes ~20 times over its life, which costs far less than the calls it saves.
JOIN_RATIO = 16


#: tokens a sliding flush encodes at once when the cache is not told (:func:`default_stride`)
DEFAULT_STRIDE = 8


def default_stride(flush: str, residual: int, sliding_window: int | None) -> int:
    """The stride of a layer built without one: :data:`DEFAULT_STRIDE` for a sliding flush with an exact window
    (attention is the same at every stride, and encoding once per S steps saves the per-step encode and block join),
    1 where nothing is read from codes ahead of need: a block flush, ``residual`` 0 (everything is packed each step),
    or a sliding-window layer whose exact window covers its window (its codes are never read)."""
    if flush != "sliding" or residual == 0 or (sliding_window is not None and sliding_window <= residual):
        return 1
    return DEFAULT_STRIDE


def join_range(block_tokens: Sequence[int], packed_length: int, base: int) -> tuple[int, int]:
    """Blocks ``[lo, hi)`` to join into one after a step (fewer than two: none).

    Blocks still holding window tokens (those ending after ``base``) stay apart; of the others,
    the newest joins the one before while that one is at most :data:`JOIN_RATIO` times as long
    as what has joined so far, repeatedly, so settled block lengths shrink geometrically and a
    layer holds O(log n) blocks."""
    hi, end = len(block_tokens), packed_length
    while hi and end > base:
        hi -= 1
        end -= block_tokens[hi]
    if hi < 2:
        return hi, hi
    lo, joined = hi - 1, block_tokens[hi - 1]
    while lo and block_tokens[lo - 1] <= JOIN_RATIO * joined:
        lo -= 1
        joined += block_tokens[lo]
    return lo, hi


def blocks_before(block_tokens: Sequence[int], start: int, position: int) -> tuple[int, int]:
    """How many leading blocks (the first at ``start``) end by ``position``, and how many tokens
    of the next block lie before it (0 at a block boundary); ``position >= start``."""
    for i, tokens in enumerate(block_tokens):
        if start + tokens > position:
            return i, position - start
        start += tokens
    return len(block_tokens), 0


def plan_crop(
    block_tokens: Sequence[int],
    tokens_to_remove: int,
    *,
    cumulative: int,
    packed_length: int,
    evicted: int,
    window: int,
    granule: int,
    layer: int,
) -> tuple[int, int]:
    """How a layer crops ``-tokens_to_remove`` tokens from its end: the whole blocks it keeps and
    the leading tokens of the next block it keeps (0: none). The window loses tokens first.

    Raises ValueError for a positive or too large count, KVQError when the layer has evicted
    tokens (a sliding window) or the cut lands inside a block where it would keep a partial
    token group: blocks split only after whole ``granule``-token groups (1: per-token layouts;
    0: not at all), since a group's statistics cover all its tokens."""
    if tokens_to_remove > 0:
        raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as DynamicLayer")
    n = -tokens_to_remove
    if n > cumulative:
        raise ValueError(f"crop: cannot remove {n} tokens from a layer holding {cumulative}")
    if n and evicted:
        raise KVQError(f"crop: layer {layer} is a sliding-window layer that has dropped its first "
                       f"{evicted} tokens; it cannot be rolled back")
    rest = max(packed_length - (cumulative - n), 0)  # packed tokens past the cut
    kept = len(block_tokens)
    while rest > 0 and kept and block_tokens[kept - 1] <= rest:
        kept -= 1
        rest -= block_tokens[kept]
    if not rest:
        return kept, 0
    keep = block_tokens[kept - 1] - rest
    if not granule or keep % granule:
        whole = "whole blocks" if not granule else f"whole {granule}-token groups of a block"
        raise KVQError(
            f"crop: removing {n} tokens cuts inside a packed block of {block_tokens[kept - 1]} tokens; "
            f"only the window ({window} tokens) and {whole} can be cropped"
        )
    return kept - 1, keep
