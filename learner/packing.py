"""Token-budget packing of a step's sequences into micro-batches, balanced across data-parallel ranks.

A step holds sequences of very different lengths (a few dozen tokens next to tens of thousands). Padding all
of them to the longest wastes most of the compute, so:

1. :func:`balance_ranks` splits the sequences across W ranks by real tokens (longest first, each to the
   least-loaded rank), so the ranks' token totals differ by at most the longest sequence.
2. :func:`plan_micro_batches` packs each rank's share into micro-batches of at most ``token_budget`` tokens.
   With varlen packing (the default) the budget counts real tokens: a micro-batch's sequences are
   concatenated into one row without padding (first-fit decreasing fills each micro-batch). Without it the
   budget counts padded tokens (rows x longest row) and lengths within a micro-batch are neighbours in sorted
   order. A sequence longer than the budget gets a micro-batch of its own (it cannot be split without
   changing the loss); that micro-batch exceeds the budget and is the only kind that may.
3. :func:`plan_step` pads every rank with empty micro-batches up to the largest count (at least one): FSDP's
   collectives run once per forward/backward, so a rank with fewer micro-batches would leave the others hanging.
4. :func:`step_inputs` does all of it for a step, optionally leaving out the sequences that carry no gradient
   (:func:`carries_gradient`: zero advantage on every loss token) while the loss normaliser still counts them.

A :class:`MicroBatch` has two layouts. The LOSS layout is per sample: ``b`` rows, right-padded to the longest
sample ``L``; every loss tensor is ``[b, L]`` and position ``t`` describes token ``input_ids[:, t]``. The
log-prob of token ``t`` is predicted from the hidden state at position ``t - 1`` and is stored at position
``t`` (position 0 gets 0: nothing predicts the first token), so ``logp_new``, ``logp_behaviour``,
``advantages`` and ``loss_mask`` line up index for index and go straight into :mod:`learner.losses`. Prompt
tokens and padding have ``loss_mask`` 0. The FORWARD layout (:class:`PackedRows`) is what the model runs on:
segments (one sequence, or with shared prompts (:func:`share_prompts`, :func:`plan_rows`) a prompt once and
the outputs of every sample that shares it) concatenated into one row, position ids restarting per segment,
with the index maps between the two layouts that the packed attention (:mod:`learner.attention`) and the loss
use. An empty micro-batch is one dummy row of one pad token with ``loss_mask`` 0: the forward and backward
run (and join the collectives) and contribute exactly zero loss and gradient.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, fields
from itertools import accumulate

import torch
from torch import Tensor

from learner.config import Aggregation


@dataclass(frozen=True)
class TrainSequence:
    """One sample to train on: the prompt and output tokens exactly as the engine saw and produced them.

    ``prompt_ids [P]`` (P >= 1) and ``output_ids [O]`` are token ids; ``logprobs [O]`` (behaviour, from the
    engine), ``versions [O]`` (policy version of each output token), ``loss_mask [O]`` (0/1) describe output
    tokens; ``advantages`` is a float (the sample's advantage) or ``[O]`` per token. ``index`` is the caller's
    id for the sequence (its position in the step), carried into ``MicroBatch.seq_index``.
    """

    prompt_ids: Tensor
    output_ids: Tensor
    logprobs: Tensor
    versions: Tensor
    loss_mask: Tensor
    advantages: Tensor | float
    index: int = -1

    def __post_init__(self) -> None:
        convert = {
            "prompt_ids": torch.long,
            "output_ids": torch.long,
            "logprobs": torch.float32,
            "versions": torch.long,
            "loss_mask": torch.float32,
        }
        for name, dtype in convert.items():
            object.__setattr__(self, name, torch.as_tensor(getattr(self, name), dtype=dtype).flatten())
        if len(self.prompt_ids) < 1:
            raise ValueError(
                f"sequence {self.index}: prompt_ids is empty; at least one prompt token is needed"
            )
        n = len(self.output_ids)
        for name in ("logprobs", "versions", "loss_mask"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"sequence {self.index}: {name} has {len(getattr(self, name))} entries, output_ids has {n}"
                )
        adv = torch.as_tensor(self.advantages, dtype=torch.float32)
        if adv.dim() > 0 and adv.numel() != n:
            raise ValueError(
                f"sequence {self.index}: advantages has {adv.numel()} entries, output_ids has {n}"
            )
        object.__setattr__(self, "advantages", adv)

    @property
    def length(self) -> int:
        """Tokens in the forward pass: prompt + output."""
        return len(self.prompt_ids) + len(self.output_ids)


# Per-sample attention of packed rows runs in buckets of similar lengths of at most this many padded tokens,
# so short samples do not pad to the longest of their micro-batch (attention cost grows with length squared).
ATTENTION_BUCKET_TOKENS = 1024


@dataclass
class PackedRows:
    """The forward layout of a micro-batch (see :mod:`learner.attention`).

    Segments, each one prompt followed by the outputs of the samples that share it (one output for a plain
    sequence), concatenated into ``r`` rows of width ``W``: with varlen packing one row holding every segment
    and no padding; without it one row per segment, right-padded to the longest. Position ids restart at 0 at
    each segment and at the prompt's length for each output, so every token sits at the position it has in
    its own sample. ``source`` and ``target`` map between this layout and the per-sample ``[b, L]`` layout.
    """

    input_ids: Tensor  # long [r, W]; pad_id in padding
    position_ids: Tensor  # long [r, W]; 0 in padding
    source: Tensor  # long [b, L]; flat row position (row * W + col) of sample i's token t (0 in padding)
    target: Tensor  # long [r * W]; position in the flattened bucket outputs that row position takes
    order: Tensor  # long [b]; the samples longest first (ties by position), the order buckets index
    buckets: list[tuple[int, int, int]]  # (start, end, length): order[start:end] attend padded to length
    real_tokens: int  # tokens in the rows, padding (and the dummy row's token) excepted
    # The same layout for a varlen attention kernel (learner.attention.varlen_attention): every sample's tokens
    # one after another, in ``order``, with no padding.
    varlen_index: Tensor  # long [sum L_i]; flat row position of each concatenated sample token
    cu_seqlens: Tensor  # int32 [b + 1]; sample boundaries in the concatenation
    varlen_target: Tensor  # long [r * W]; position in the concatenation that row position takes
    max_seqlen: int  # the longest sample

    @property
    def varlen(self) -> tuple[Tensor, Tensor, Tensor, int]:
        """The varlen kernel's maps, as ``learner.attention`` takes them."""
        return self.varlen_index, self.cu_seqlens, self.varlen_target, self.max_seqlen

    def to(self, device: torch.device | str) -> PackedRows:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return PackedRows(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in moved.items()})


@dataclass
class MicroBatch:
    """One forward/backward: per-sample ``[b, L]`` loss tensors and the packed forward layout ``packed``
    (both in the module docstring). The forward runs on ``packed``; its log-probs are scattered back into this
    ``[b, L]`` layout, where the loss sees them as usual.
    """

    input_ids: Tensor  # long [b, L]; pad_id in padding
    attention_mask: Tensor  # long [b, L]; 1 on real tokens
    position_ids: Tensor  # long [b, L]; 0..L-1 per row (each sample's own positions)
    logp_behaviour: Tensor  # float32 [b, L]; the engine's log-prob of token t, 0 off outputs
    versions: Tensor  # long [b, L]; policy version of token t, -1 off outputs
    loss_mask: Tensor  # float32 [b, L]; 1 where token t is trained
    advantages: Tensor  # float32 [b, L]; 0 off outputs
    seq_index: Tensor  # long [b]; TrainSequence.index per row, -1 for the dummy row
    packed: PackedRows

    @property
    def num_tokens(self) -> int:
        """Real tokens in the forward pass (each shared prompt once), the dummy row's excepted."""
        return self.packed.real_tokens

    @property
    def padded_tokens(self) -> int:
        """Tokens the token-wise layers run on, padding included: ``num_tokens`` with varlen packing (the
        dummy row's one token aside), rows x longest row without it."""
        return self.packed.input_ids.numel()

    @property
    def shares_prompts(self) -> bool:
        """Whether some prompt runs once for several samples (fewer forward tokens than sample tokens)."""
        return self.num_tokens < int(self.attention_mask[self.seq_index >= 0].sum())

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def is_empty(self) -> bool:
        return bool((self.seq_index < 0).all())

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return MicroBatch(**{k: v.to(device) for k, v in moved.items()})


@dataclass(frozen=True)
class StepPlan:
    """Sequence indices per rank per micro-batch: ``ranks[r][k]`` lists the sequences of rank r's k-th
    micro-batch (an empty list is an empty micro-batch). Every rank has the same number of micro-batches."""

    ranks: list[list[list[int]]]
    lengths: list[int]

    @property
    def micro_batches_per_rank(self) -> int:
        return len(self.ranks[0]) if self.ranks else 0

    def rank_tokens(self) -> list[int]:
        """Real tokens per rank."""
        return [sum(self.lengths[i] for mb in rank for i in mb) for rank in self.ranks]


def _check_lengths(lengths: Sequence[int]) -> None:
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"sequence {i} has length {n}; every sequence needs at least one token")


def balance_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Split sequence indices across ``world_size`` ranks by real tokens (longest-processing-time first).

    Each sequence, longest first, goes to the rank with the fewest tokens so far (ties: fewer sequences, then
    lower rank), so ``max - min`` of the rank totals is at most the longest sequence.
    """
    if world_size < 1:
        raise ValueError(f"world_size = {world_size} must be at least 1")
    _check_lengths(lengths)
    heap = [(0, 0, r) for r in range(world_size)]
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, count, r = heapq.heappop(heap)
        ranks[r].append(i)
        heapq.heappush(heap, (tokens + lengths[i], count + 1, r))
    return ranks


def plan_micro_batches(lengths: Sequence[int], token_budget: int, varlen: bool = True) -> list[list[int]]:
    """Pack sequence indices into micro-batches of at most ``token_budget`` tokens, longest first.

    ``varlen``: the budget counts real tokens (the sequences share one row, unpadded); each sequence, longest
    first, goes to the first micro-batch it fits in (first-fit decreasing), else opens a new one. Without
    ``varlen`` the budget counts padded tokens: a micro-batch takes the next sequence in sorted order while
    ``(rows + 1) x its first (longest) length`` fits, so lengths within it are neighbours and padding stays
    small. Either way a sequence longer than the budget is alone in its micro-batch.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget = {token_budget} must be at least 1")
    _check_lengths(lengths)
    ordered = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return _first_fit(ordered, lengths, token_budget) if varlen else _next_fit(ordered, lengths, token_budget)


def _first_fit(ordered: list[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    batches: list[list[int]] = []
    loads: list[int] = []
    for i in ordered:
        k = next((k for k, load in enumerate(loads) if load + lengths[i] <= budget), len(batches))
        if k == len(batches):
            batches.append([])
            loads.append(0)
        batches[k].append(i)
        loads[k] += lengths[i]
    return batches


def _next_fit(ordered: list[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in ordered:
        if current and (len(current) + 1) * longest > budget:
            batches.append(current)
            current = []
        if not current:
            longest = lengths[i]
        current.append(i)
    if current:
        batches.append(current)
    return batches


def plan_step(lengths: Sequence[int], world_size: int, token_budget: int, varlen: bool = True) -> StepPlan:
    """Balance across ranks, pack each rank by the budget, pad all ranks to the same micro-batch count."""
    per_rank: list[list[list[int]]] = []
    for share in balance_ranks(lengths, world_size):
        local = plan_micro_batches([lengths[i] for i in share], token_budget, varlen)
        per_rank.append([[share[j] for j in mb] for mb in local])
    # at least one (then empty) micro-batch: a step left with nothing to run still runs forward and backward,
    # so every rank joins the collectives and the optimizer sees zero gradients, as the whole step would give
    count = max(1, max((len(r) for r in per_rank), default=0))
    for r in per_rank:
        r.extend([] for _ in range(count - len(r)))
    return StepPlan(ranks=per_rank, lengths=list(lengths))


def share_prompts(seqs: Sequence[TrainSequence], token_budget: int) -> list[list[int]]:
    """Forward segments of a step: indices of sequences that share a prompt, one prompt per segment.

    Sequences with identical prompt ids (a group's samples) are taken in order; a segment takes the next one
    while it (the prompt once plus every output) stays within ``token_budget``, so sharing never makes a
    segment longer than the budget unless a single sequence already is (it then has a segment of its own).
    """
    if token_budget < 1:
        raise ValueError(f"token_budget = {token_budget} must be at least 1")
    by_prompt: dict[bytes, list[int]] = {}
    for i, s in enumerate(seqs):
        by_prompt.setdefault(s.prompt_ids.numpy().tobytes(), []).append(i)
    rows: list[list[int]] = []
    for members in by_prompt.values():
        row: list[int] = []
        width = 0
        for i in members:
            output = len(seqs[i].output_ids)
            if row and width + output > token_budget:
                rows.append(row)
                row = []
            if not row:
                width = len(seqs[i].prompt_ids)
            row.append(i)
            width += output
        rows.append(row)
    return rows


def plan_rows(
    seqs: Sequence[TrainSequence], world_size: int, token_budget: int, share: bool, varlen: bool = True
) -> tuple[list[list[int]], StepPlan]:
    """A step's forward segments (shared prompts when ``share``, else one sequence each) and their plan."""
    rows = share_prompts(seqs, token_budget) if share else [[i] for i in range(len(seqs))]
    return rows, plan_step(row_lengths(seqs, rows), world_size, token_budget, varlen)


def row_lengths(seqs: Sequence[TrainSequence], rows: Sequence[Sequence[int]]) -> list[int]:
    """Tokens of each segment: its prompt once plus all its outputs."""
    return [len(seqs[r[0]].prompt_ids) + sum(len(seqs[i].output_ids) for i in r) for r in rows]


def _check_rows(seqs: Sequence[TrainSequence], rows: Sequence[Sequence[int]]) -> None:
    if sorted(i for r in rows for i in r) != list(range(len(seqs))):
        raise ValueError(f"rows {[list(r) for r in rows]} must split sequences 0..{len(seqs) - 1}, each once")
    for r in rows:
        for i in r[1:]:
            if not torch.equal(seqs[i].prompt_ids, seqs[r[0]].prompt_ids):
                raise ValueError(f"sequences {r[0]} and {i} share a row but not a prompt")


def _attention_buckets(sorted_lengths: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(start, end, length)`` ranges of samples (sorted longest first) padded together in attention.

    Padded packing orders by (length descending, index), which is already the order here, so each of its
    micro-batches is a contiguous range."""
    batches = plan_micro_batches(sorted_lengths, ATTENTION_BUCKET_TOKENS, varlen=False)
    return [(b[0], b[-1] + 1, sorted_lengths[b[0]]) for b in batches]


def _packed_rows(
    seqs: Sequence[TrainSequence], rows: Sequence[Sequence[int]], pad_id: int, varlen: bool
) -> PackedRows:
    """The forward layout of ``seqs`` under ``rows`` (segments): one unpadded row, or one padded row each."""
    seg_lengths = row_lengths(seqs, rows)
    width = sum(seg_lengths) if varlen else max(seg_lengths)
    bases = [0, *accumulate(seg_lengths)][:-1] if varlen else [u * width for u in range(len(rows))]
    order = sorted(range(len(seqs)), key=lambda i: (-seqs[i].length, i))
    buckets = _attention_buckets([seqs[i].length for i in order])
    flat_start: dict[int, int] = {}  # sample -> its first position in the flattened bucket outputs
    offset = 0
    for start, end, length in buckets:
        for j in range(start, end):
            flat_start[order[j]] = offset + (j - start) * length
        offset += (end - start) * length
    n_rows = 1 if varlen else len(rows)
    lengths = [seqs[i].length for i in order]
    out = PackedRows(
        input_ids=torch.full((n_rows, width), pad_id, dtype=torch.long),
        position_ids=torch.zeros(n_rows, width, dtype=torch.long),
        source=torch.zeros(len(seqs), max(s.length for s in seqs), dtype=torch.long),
        target=torch.zeros(n_rows * width, dtype=torch.long),
        order=torch.tensor(order, dtype=torch.long),
        buckets=buckets,
        real_tokens=sum(seg_lengths),
        varlen_index=torch.zeros(sum(lengths), dtype=torch.long),
        cu_seqlens=torch.tensor([0, *accumulate(lengths)], dtype=torch.int32),
        varlen_target=torch.zeros(n_rows * width, dtype=torch.long),
        max_seqlen=lengths[0],
    )
    for base, members in zip(bases, rows, strict=True):
        _place_segment(out, seqs, members, base, flat_start)
    _place_varlen(out, order, lengths)
    return out


def _place_varlen(out: PackedRows, order: Sequence[int], lengths: Sequence[int]) -> None:
    """Fill the varlen maps from ``source`` and ``target``: the concatenation is the bucket layout without
    its padding, so each bucket position maps to the same sample token's concatenated position."""
    cu = out.cu_seqlens.tolist()
    out.varlen_index.copy_(torch.cat([out.source[i, :n] for i, n in zip(order, lengths, strict=True)]))
    bucket_to_cat = torch.zeros(sum((e - s) * n for s, e, n in out.buckets), dtype=torch.long)
    offset = 0
    for start, end, width in out.buckets:
        for j in range(start, end):
            at = offset + (j - start) * width
            bucket_to_cat[at : at + lengths[j]] = cu[j] + torch.arange(lengths[j])
        offset += (end - start) * width
    out.varlen_target.copy_(bucket_to_cat[out.target])


def _place_segment(
    out: PackedRows,
    seqs: Sequence[TrainSequence],
    members: Sequence[int],
    base: int,
    flat_start: dict[int, int],
) -> None:
    """Write one segment (a prompt, then the outputs of ``members``) at flat row position ``base``."""
    ids, pos = out.input_ids.view(-1), out.position_ids.view(-1)
    prompt = seqs[members[0]].prompt_ids
    p = len(prompt)
    ids[base : base + p] = prompt
    pos[base : base + p] = torch.arange(p)
    out.target[base : base + p] = flat_start[members[0]] + torch.arange(p)  # the first sample's copy
    col = base + p
    for i in members:
        o = len(seqs[i].output_ids)
        ids[col : col + o] = seqs[i].output_ids
        pos[col : col + o] = torch.arange(p, p + o)
        out.source[i, :p] = base + torch.arange(p)
        out.source[i, p : p + o] = col + torch.arange(o)
        out.target[col : col + o] = flat_start[i] + p + torch.arange(o)
        col += o


def collate(
    seqs: Sequence[TrainSequence],
    pad_id: int = 0,
    rows: Sequence[Sequence[int]] | None = None,
    varlen: bool = True,
) -> MicroBatch:
    """Collate ``seqs`` (in the given order) into one :class:`MicroBatch`; no sequences gives the dummy row.

    ``rows`` (indices into ``seqs``, each sequence once, a row's sequences sharing one prompt) are the forward
    segments; by default each sequence is its own. ``varlen`` packs every segment into one unpadded row;
    otherwise each segment is a row, right-padded to the longest.
    """
    if not seqs:
        return _dummy(pad_id)
    rows = [[i] for i in range(len(seqs))] if rows is None else rows
    _check_rows(seqs, rows)
    return MicroBatch(**_sample_tensors(seqs, pad_id), packed=_packed_rows(seqs, rows, pad_id, varlen))


def _dummy(pad_id: int) -> MicroBatch:
    one = torch.ones(1, 1, dtype=torch.long)
    zero_f = torch.zeros(1, 1)
    zero = torch.zeros(1, dtype=torch.long)
    packed = PackedRows(
        input_ids=one * pad_id,
        position_ids=one * 0,
        source=one * 0,
        target=zero,
        order=zero.clone(),
        buckets=[(0, 1, 1)],
        real_tokens=0,
        varlen_index=zero.clone(),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
        varlen_target=zero.clone(),
        max_seqlen=1,
    )
    return MicroBatch(
        input_ids=one * pad_id,
        attention_mask=one,
        position_ids=one * 0,
        logp_behaviour=zero_f,
        versions=-one,
        loss_mask=zero_f.clone(),
        advantages=zero_f.clone(),
        seq_index=torch.tensor([-1]),
        packed=packed,
    )


def _sample_tensors(seqs: Sequence[TrainSequence], pad_id: int) -> dict[str, Tensor]:
    """The per-sample ``[b, L]`` fields of a :class:`MicroBatch`, right-padded to the longest sample."""
    b, width = len(seqs), max(s.length for s in seqs)
    t = {
        "input_ids": torch.full((b, width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros(b, width, dtype=torch.long),
        "position_ids": torch.arange(width).expand(b, width).clone(),
        "logp_behaviour": torch.zeros(b, width),
        "versions": torch.full((b, width), -1, dtype=torch.long),
        "loss_mask": torch.zeros(b, width),
        "advantages": torch.zeros(b, width),
        "seq_index": torch.tensor([s.index for s in seqs], dtype=torch.long),
    }
    for row, s in enumerate(seqs):
        p, n = len(s.prompt_ids), s.length
        t["input_ids"][row, :p] = s.prompt_ids
        t["input_ids"][row, p:n] = s.output_ids
        t["attention_mask"][row, :n] = 1
        t["logp_behaviour"][row, p:n] = s.logprobs
        t["versions"][row, p:n] = s.versions
        t["loss_mask"][row, p:n] = s.loss_mask
        t["advantages"][row, p:n] = s.advantages
    return t


def rank_micro_batches(
    seqs: Sequence[TrainSequence],
    plan: StepPlan,
    rank: int,
    pad_id: int = 0,
    rows: Sequence[Sequence[int]] | None = None,
    varlen: bool = True,
) -> list[MicroBatch]:
    """The collated micro-batches of ``rank`` under ``plan``.

    Without ``rows`` the plan was made over the sequences' lengths (``seqs`` indexed like ``plan.lengths``);
    with ``rows`` (from :func:`share_prompts`) it was made over :func:`row_lengths` and lists row indices.
    """
    if rows is None:
        rows = [[i] for i in range(len(seqs))]
    if len(rows) != len(plan.lengths):
        raise ValueError(f"plan covers {len(plan.lengths)} rows, got {len(rows)}")
    batches = []
    for mb in plan.ranks[rank]:
        members = [i for u in mb for i in rows[u]]
        local: list[list[int]] = []  # the rows again, as positions in ``members``
        for u in mb:
            start = local[-1][-1] + 1 if local else 0
            local.append(list(range(start, start + len(rows[u]))))
        batches.append(collate([seqs[i] for i in members], pad_id, local, varlen))
    return batches


def step_loss_units(seqs: Sequence[TrainSequence], aggregation: Aggregation) -> int:
    """The global loss normaliser of a step (see ``learner.losses.loss_units``): loss tokens for
    ``token-mean``, sequences with at least one loss token for the ``seq-*`` modes."""
    if aggregation == "token-mean":
        return int(sum(int(s.loss_mask.sum()) for s in seqs))
    return sum(1 for s in seqs if bool((s.loss_mask > 0).any()))


def carries_gradient(seq: TrainSequence) -> bool:
    """Whether any loss token of ``seq`` has a nonzero advantage.

    Every policy loss scales a token's gradient by its advantage and its loss mask (the reference KL, whose
    gradient does not, is the caller's to rule out), so a sequence without such a token adds exactly zero to
    the gradient: every sample of a group whose rewards are all equal (its advantages are exactly 0).
    """
    live = seq.loss_mask > 0
    adv = seq.advantages
    if isinstance(adv, float) or adv.dim() == 0:
        return float(adv) != 0.0 and bool(live.any())
    return bool((live & (adv != 0)).any())


@dataclass
class StepInputs:
    """What every rank runs in one optimizer step."""

    micro_batches: list[list[MicroBatch]]  # per rank; every rank has the same number
    temperatures: list[list[Tensor]]  # per rank and micro-batch: float [b], each row's sampling temperature
    normaliser: float  # the step's global loss normaliser (over all sequences, skipped ones included)
    skipped: int  # sequences left out because they carry no gradient
    skipped_tokens: int  # their tokens (prompt + output), the forward work saved


def step_inputs(
    seqs: Sequence[TrainSequence],
    temps: Sequence[float],
    world_size: int,
    token_budget: int,
    share: bool,
    aggregation: Aggregation,
    skip_zero_gradient: bool,
    varlen: bool = True,
) -> StepInputs:
    """Plan and collate a step for ``world_size`` ranks. ``temps[i]`` is the temperature of ``seqs[i]``.

    With ``skip_zero_gradient`` the sequences that carry no gradient (:func:`carries_gradient`) are not run;
    the normaliser still counts them, so the loss, the gradient and the update are those of the whole step.
    ``varlen``: pack each micro-batch into one unpadded row (see :func:`plan_micro_batches`).
    """
    normaliser = float(max(1, step_loss_units(seqs, aggregation)))
    kept = [s for s in seqs if carries_gradient(s)] if skip_zero_gradient else list(seqs)
    rows, plan = plan_rows(kept, world_size, token_budget, share, varlen)
    per_rank = [rank_micro_batches(kept, plan, rank, rows=rows, varlen=varlen) for rank in range(world_size)]
    rank_temps = [
        [torch.tensor([temps[i] if i >= 0 else 1.0 for i in mb.seq_index.tolist()]) for mb in mbs]
        for mbs in per_rank
    ]
    skipped = len(seqs) - len(kept)
    skipped_tokens = sum(s.length for s in seqs) - sum(s.length for s in kept)
    return StepInputs(per_rank, rank_temps, normaliser, skipped, skipped_tokens)
