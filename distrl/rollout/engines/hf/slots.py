"""The slot state of :class:`distrl.rollout.engines.hf.continuous.ContinuousSampler`: its static buffers, its KV cache
(one :class:`SlotLayer` per decoder layer, each slot written at its own position), the host's snapshots, the rows
it hands back (:class:`Finished`), and :func:`move_rows`, which moves running rows into lower slots (the tail's
smaller step, of one of :func:`buckets`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

MIN_BUCKET = 8  # the fewest slots a decode step runs once no row waits (ContinuousSampler._shrink)


def buckets(b: int) -> list[int]:
    """The slot counts a decode step of B slots runs, largest first: B, then quarters while at least MIN_BUCKET
    (each is one more captured graph on CUDA, all made at the end of a state's first call)."""
    out = [b]
    while out[-1] // 4 >= MIN_BUCKET:
        out.append(out[-1] // 4)
    return out


@dataclass
class Finished:
    """A row handed back: its index in ``run``'s rows, tokens and logprobs (T,), whether it ended on a stop
    token, and ``stamp()`` when it was admitted and when it was handed back."""

    row: int
    tokens: list[int]
    logprobs: list[float]
    stopped: bool
    versions: tuple[int, int]


class SlotLayer(CacheLayerMixin):
    """One layer's K/V, stored (B, L, Hkv, D) (a slot's positions are contiguous rows, as FlashAttention's
    variable-length kernel reads them: :func:`distrl.rollout.engines.hf.kernels.slot_attention`) and handed to attention
    as (B, Hkv, L, D) views. Decode writes each slot at its own position ``owner.pos``; a prefill writes rows
    ``owner.prefill_slots`` at positions 0..Q-1 and attends to its own K/V only."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: "SlotState"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, length = self.owner.valid.shape
        shape = (self.owner.kv_slots or b, length, key_states.shape[1])
        self.keys = torch.zeros((*shape, key_states.shape[-1]), dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros((*shape, value_states.shape[-1]), dtype=value_states.dtype,
                                  device=value_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows = self.owner.prefill_slots
        if rows is None:  # decode: key_states (n, Hkv, 1, D) for the first n slots, each at its own position
            # index_put_ writes n x Hkv x D elements in place; under torch.compile a scatter_ here copied the
            # whole cache twice a step
            n = key_states.shape[0]
            where = (torch.arange(n, device=key_states.device), self.owner.pos[:n])
            self.keys.index_put_(where, key_states[:, :, 0])  # (n, Hkv, D) at (slot, its position)
            self.values.index_put_(where, value_states[:, :, 0])
            return self.keys[:n].transpose(1, 2), self.values[:n].transpose(1, 2)
        q = key_states.shape[2]  # prefill: (k, Hkv, Q, D) for the slots `rows`
        self.keys[rows, :q] = key_states.transpose(1, 2)
        self.values[rows, :q] = value_states.transpose(1, 2)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.valid.shape[1], 0

    def get_seq_length(self) -> int:
        return 0  # positions are always given

    def get_max_length(self) -> int:
        return self.owner.valid.shape[1]


@dataclass
class SlotState:
    """The static buffers of B slots, L cache positions, S + 1 output columns (the last: a sink for rows
    that are done); captured graphs point into them."""

    valid: torch.Tensor  # (B, L) bool: position holds the slot's row
    tok: torch.Tensor  # (B,) long: the tokens the next step feeds
    pos: torch.Tensor  # (B,) long: their positions (= cache positions)
    tokens: torch.Tensor  # (B, S + 1) long
    logps: torch.Tensor  # (B, S + 1) fp32
    lengths: torch.Tensor  # (B,) long
    stopped: torch.Tensor  # (B,) bool
    done: torch.Tensor  # (B,) bool (a free slot is done)
    budget: torch.Tensor  # (B,) long
    temperature: torch.Tensor  # () fp32, 0 when greedy
    seed: torch.Tensor  # (1,) long: the decode step's Philox seed (kernels.sample_rows), advanced every step
    prefill_slots: torch.Tensor | None = None  # set while admitted rows are prefilled
    cache: Cache | None = None
    graphs: dict = field(default_factory=dict)  # slots decoded -> torch.cuda.CUDAGraph (greedy and sampled)
    host: list | None = None  # CUDA: two sets of pinned buffers for the snapshots, used in turn
    index: torch.Tensor | None = None  # (B,) long: 0..B-1; the step of n slots gets index[:n]
    kv_slots: int | None = None  # the K/V's slots when reserved (>= B; ContinuousSampler.reserve), else B

    def __post_init__(self):
        self.index = torch.arange(self.tok.shape[0], device=self.tok.device)

    @classmethod
    def empty(cls, model, b: int, length: int, s: int, seed_from: torch.Generator | None,
              kv_slots: int | None = None) -> "SlotState":
        """B free slots of ``length`` cache positions and S + 1 output columns for ``model``, with a
        :class:`SlotLayer` per decoder layer. ``seed_from``: the generator the decode kernels' Philox seed is drawn
        from (None: no kernels, and nothing drawn, so the portable path's random stream stays as it was).
        ``kv_slots``: the K/V's slot count, the same in every state (a reservation, >= B); None: B."""
        if kv_slots is not None and kv_slots < b:
            raise ValueError(f"a state of {b} slots with K/V for {kv_slots}")
        dev = model.device
        long = dict(dtype=torch.long, device=dev)
        seed = torch.zeros(1, **long) if seed_from is None else torch.randint(0, 2**39, (1,), generator=seed_from,
                                                                               device=dev)
        st = cls(valid=torch.zeros((b, length), dtype=torch.bool, device=dev), tok=torch.zeros(b, **long),
                 pos=torch.zeros(b, **long), tokens=torch.zeros((b, s + 1), **long),
                 logps=torch.zeros((b, s + 1), dtype=torch.float32, device=dev), lengths=torch.zeros(b, **long),
                 stopped=torch.zeros(b, dtype=torch.bool, device=dev),
                 done=torch.ones(b, dtype=torch.bool, device=dev), budget=torch.zeros(b, **long),
                 temperature=torch.ones((), dtype=torch.float32, device=dev), seed=seed, kv_slots=kv_slots)
        st.cache = Cache(layers=[SlotLayer(st) for _ in range(model.config.get_text_config().num_hidden_layers)])
        return st

    def snapshot(self, k: int) -> "Snapshot":
        """Interval ``k``'s done/lengths/stopped/tokens/logps as the host will read them.

        On CUDA: copied behind the queued steps into the state's two pinned buffer sets, used in turn (a
        snapshot is read before the next but one is taken). On CPU, where nothing is queued, only ``done`` is
        copied: the other outputs of a slot that ``done`` shows ended stay as they are until the slot is
        refilled, and the sampler's hand-back never reads a slot refilled after its snapshot."""
        names = ("done", "lengths", "stopped", "tokens", "logps")
        if self.tok.device.type != "cuda":
            return Snapshot(k, self.done.clone(), *(getattr(self, n) for n in names[1:]))
        if self.host is None:
            self.host = [[torch.empty_like(getattr(self, n), device="cpu").pin_memory() for n in names]
                         for _ in range(2)]
        host = self.host[k % 2]
        for dst, n in zip(host, names):
            dst.copy_(getattr(self, n), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return Snapshot(k, *host, event)

    def mark_dynamic(self) -> None:
        """Make slots (dim 0), cache positions and output columns (dim 1, the K/V's too) symbolic sizes for
        torch.compile, so every state and tail bucket shares one compilation
        (``distrl.rollout.engines.hf.decode.compiled_step``). The K/V's slots stay a constant where they are
        reserved (``kv_slots``, the same in every state): Dynamo then traces each layer's K/V with one symbolic
        size, not two (8-15 % less of the step's tracing on the VM, BENCHMARKS.md, twenty-second round). Call
        after the first prefill (the K/V exist then)."""
        for name in ROW_BUFFERS + ("index",):
            buf = getattr(self, name)
            torch._dynamo.maybe_mark_dynamic(buf, tuple(range(buf.dim())))
        for layer in self.cache.layers:
            for kv in (layer.keys, layer.values):
                torch._dynamo.maybe_mark_dynamic(kv, (1,) if self.kv_slots else (0, 1))


@dataclass
class Snapshot:
    """The host's copy of the slots' outputs after interval ``interval`` (:meth:`SlotState.snapshot`);
    ``event`` marks the copy's end on CUDA (None on CPU, where the copy is done)."""

    interval: int
    done: torch.Tensor
    lengths: torch.Tensor
    stopped: torch.Tensor
    tokens: torch.Tensor
    logps: torch.Tensor
    event: "torch.cuda.Event | None" = None


ROW_BUFFERS = ("valid", "tok", "pos", "tokens", "logps", "lengths", "stopped", "done", "budget")


def move_rows(st: SlotState, src: list[int], dst: list[int]) -> None:
    """Move the rows in slots ``src`` to the free slots ``dst`` (same length): each layer's K/V and every
    per-slot buffer copied on the device, in one index copy each; the slots left are marked done (free)."""
    frm, to = _on_device(st, src, dst)
    for layer in st.cache.layers:
        layer.keys[to] = layer.keys[frm]
        layer.values[to] = layer.values[frm]
    for name in ROW_BUFFERS:
        buf = getattr(st, name)
        buf[to] = buf[frm]
    st.done[frm] = True


def copy_prefix(st: SlotState, src: list[int], dst: list[int], q: int) -> None:
    """Copy positions 0..q-1 of each layer's K/V from slots ``src`` to slots ``dst`` (same length; a source may
    repeat): rows of the same prompt then share its prefill. The other per-slot buffers are the caller's."""
    frm, to = _on_device(st, src, dst)
    for layer in st.cache.layers:
        layer.keys[to, :q] = layer.keys[frm, :q]
        layer.values[to, :q] = layer.values[frm, :q]


def _on_device(st: SlotState, src: list[int], dst: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``src`` and ``dst`` as index tensors on the slots' device, in one pinned, non-blocking copy."""
    dev = st.tok.device
    index = torch.tensor([src, dst])
    index = (index.pin_memory() if dev.type == "cuda" else index).to(dev, non_blocking=True)
    return index[0], index[1]
