"""``ASYNC=1``: the engine's half of the round hand-off through the shared region.

A round is reserved, its descriptor and rows written into a depth slot, ``gathered``
published (by this thread on the CPU, by the stream on CUDA), and the answer read from
the slot's drafts once ``released`` says so. Who answers is not this module's business:
the proxy host (:mod:`.proxy_host`) runs the proxy and says, before every round, which
one serves (:meth:`Handoff.served_by`); a round is answered here only when no proxy
serves (at once, target-only), when a proxy was lost (its rounds) and when the engine
closes (every round still in flight), through the ring's engine end
(``EngineEnd.drain``, ``EngineEnd.fence``).

Building :class:`Handoff` is the self-test: the native library loads, the region
maps, the watchdog starts, and on CUDA the region registers and the stream's hand-off
answers a probe.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch

from ... import native
from ...config.mode import Mode
from ...outcome import Outcome
from ...shm import memfd, ring, streamsync
from ..lifecycle import Users
from ..observe.stats import EngineCounts, HandoffStats, LinkStats
from ..spec import Spec
from ..values.batch import Batch, as_bytes, gather_rows_host, has_rows, meta_to_host
from ..values.drafts import Drafts, Launched, empty_drafts, round_tensors, to_drafts
from ..values.slot_views import DeviceSlots, SlotViews
from ..writers.device_meta import check_meta_shapes, write_meta_in_stream
from ..writers.host_round import HostRound
from ..writers.native_meta import NativeMeta, write_round_meta

log = logging.getLogger("remote_dspark.engine")

STALL_ROUNDS = 3  # watchdog releases in a row that mark a live proxy stalled
HOLD_GIL_US = 50  # process mode: spin this long holding the GIL before releasing it


def _no_proxy() -> int:
    """No host has said which proxy serves: none does."""
    return 0


class Handoff:
    """The region, its views and the engine's end of the ring. Used by the engine thread
    (rounds), the proxy host's threads (answers for a lost proxy) and ``close``; each
    enters :attr:`users` first, and the last to leave unmaps the region."""

    def __init__(self, spec: Spec, counts: EngineCounts):
        self.spec = spec
        self.counts = counts
        cfg = spec.cfg
        self.lib = native.load(spec.environ)
        self.region = memfd.Region.create(
            memfd.Layout(
                spec.depth, spec.max_slots, spec.row_bytes, spec.num_spec, spec.max_tokens, sampled=spec.sampled
            )
        )
        self.users = Users(self._free)
        try:
            self.end = ring.EngineEnd(self.region, self.lib)
            self.watchdog = self.end.start_watchdog(cfg.watchdog_ms)
            # Process mode on the CPU: the proxy answers within microseconds, so the
            # engine thread keeps its GIL for the first 50 us of the wait and, in the
            # common case, never hands it to another engine thread mid-round
            # (docs/benchmarks.md). Thread mode must release it at once: its proxy needs it.
            hold_us = HOLD_GIL_US if spec.mode is Mode.PROCESS and spec.device == "cpu" else 0
            self.sync = streamsync.HostFlagSync(
                self.region,
                self.lib,
                backend=spec.device,
                spin_us=cfg.async_spin_us,
                nap_us=cfg.async_nap_us,
                hold_gil_us=hold_us,
            )
            self._host = [SlotViews(self.region, i) for i in range(spec.depth)]
            # Host metadata by one C call where it takes the batch (a sampled engine's: Python);
            # on the CPU the whole hand-over and the answer's copy too, and every engine's
            # summary of a released round (host_round).
            acked_at = self.end.header.context_at  # each C call reads the worker's context for its cut
            self._native_meta = None if spec.sampled else NativeMeta(self.lib, spec, acked_at)
            self._host_round = HostRound(self.lib, self.region, spec, self._native_meta, hold_us)
            if spec.device == "cuda":
                self._dev = DeviceSlots(self.region, self.sync.backend.device_view)
                self._device = torch.device("cuda", torch.cuda.current_device())
            from ..writers import device_meta, gather, native_launch

            # launch()'s stream work in one C call where its kernel checks out (else torch's launches).
            self._launcher = native_launch.choose(cfg.fused_gather, self.lib, self.sync.backend, self.region, spec)
            if self._launcher is None:
                self._gather = gather.choose(cfg.fused_gather, spec.device)
            self._meta_kernel = device_meta.choose(spec.device)  # compiled and checked now, not in a round
        except BaseException:
            if self._launcher is not None:
                self._launcher.close()
            self._free()
            raise
        self._serving_session: Callable[[], int] = _no_proxy  # the proxy host's word (served_by)
        self._served_session = 0  # the session of the last round handed to a proxy
        self._served_epoch = 0  # the proxy's link epoch at that round
        self._resync: set[int] = set()  # CUDA: slots lost in rounds collected since the last launch
        self._pending: list[int] = []  # CUDA: rounds launched, not yet collected
        self._reserve_s = cfg.watchdog_ms / 1000.0 * (spec.depth + 1)  # room comes back within this
        self._limit_s = 2 * cfg.watchdog_ms / 1000.0 + 1.0  # CPU: far past the watchdog, a broken ring
        # When the engine thread saw each of the last STALL_ROUNDS rounds in a row that the
        # watchdog answered (empty after any other outcome). Its one writer is the engine
        # thread; the proxy host's stall verdict only reads it (one tuple: one atomic read).
        self.watchdog_seen: tuple[float, ...] = ()
        self.max_wait_s = 0.0  # longest hand-off wait of the engine thread (CPU)
        self.wait_cpu_s = 0.0  # the engine thread's CPU inside those waits (their spins)

    _launcher = None  # CUDA: the native launch (native_launch.NativeLaunch), when it checked out
    _host_round: HostRound | None = None  # the host side in C (None once the region is freed)
    _host: list = []
    _dev: DeviceSlots | None = None  # CUDA: the stream's views of the slots

    def served_by(self, serving_session: Callable[[], int]) -> None:
        """The proxy host's word, asked before every round: the session of the proxy that
        serves, 0 if none. Until a host gives it, no proxy serves."""
        self._serving_session = serving_session

    def serving_session(self) -> int:
        """The session of the proxy that serves now, 0 if none (its host's word)."""
        return self._serving_session()

    def _free(self) -> None:
        """The last user left: forget every view of the region (numpy and device), stop
        the watchdog (a close hook) and unmap."""
        self._host, self._dev, self._host_round, self._native_meta = [], None, None, None  # (addresses too)
        self.region.close()

    # ------------------------------------------------------------------ rounds

    def _proxy(self) -> tuple[bool, bool]:
        """Engine thread, before a round: (a proxy serves, a new worker session). No
        proxy: counted, and the round is answered here at once. A new proxy (another
        session than the last round's) has a new connection, and so has a proxy whose
        link epoch moved (it switched to its spare, or reconnected): the worker holds no
        window for this engine there, so the first round on it says resync_all."""
        session = self._serving_session()
        if not session:
            self.end.counters.add("no_proxy_rounds")
            # A round answered here costs the engine nothing, and the threads making a
            # proxy serve again (the supervisor's, a proxy thread) need this GIL: let them
            # have it now rather than after a whole switch interval (5 ms by default).
            time.sleep(0)
            return False, False
        epoch = self.end.header.link_epoch
        new = self._served_session not in (0, session) or self._served_epoch not in (0, epoch)
        self._served_session, self._served_epoch = session, epoch
        return True, new

    def _hand_over(
        self, batch: Batch, stream: int | None = None, out: tuple = (), status=None
    ) -> tuple[int, bool | None]:
        """Reserve a round, write its descriptor and rows and signal ``gathered``: the
        round id, and whether it was released within the host round's hold (None: no hold
        spun; the caller waits). By the native launch on CUDA, the stream's wait and the
        copies of the answer into ``out`` (``drafts.round_tensors``) are enqueued here too;
        otherwise the caller enqueues the wait. ``status``: where the native launch copies
        the outcome."""
        spec, cfg = self.spec, self.spec.cfg
        r = self.end.reserve(self._reserve_s)
        i = r & (spec.depth - 1)
        try:
            if spec.device == "cpu":  # the hand-over in one C call, where it takes the batch
                released = self._host_round.hand_over(batch, r)
                if released is not None:
                    self.wait_cpu_s += self._host_round.spin_cpu_s  # its spin for the release is the wait's
                    return r, released
            self._collect()
            v = self._host[i]
            v.round_word[0] = r
            if not self._meta_kernel and spec.device == "cuda" and batch.meta_on_device:
                batch = meta_to_host(batch)  # no device writer (device_meta.choose): one sync, then the host path
            if write_round_meta(spec, self._native_meta, batch, v.desc, v.desc_addr, self.acked_context) is None:
                if spec.device != "cuda":
                    raise ValueError("batch metadata on a device, but RemoteDSpark runs on the CPU")
                self._write_device_meta(batch, i, cfg.timeout_ms, spec.context_cut(self.acked_context()))
            rows = has_rows(batch, spec.row_bytes)
            if self._launcher is not None:
                stream = streamsync.current_stream(torch) if stream is None else stream  # (the default stream is 0)
                self._launcher.launch(stream, r, batch, rows, out, status)
                return r, None
            if not rows:
                pass  # an engine without rows: no staging, nothing to gather
            elif spec.device == "cpu":
                gather_rows_host(
                    batch,
                    self._host[i].staging,
                    spec.row_bytes,
                    self.lib,
                    self.region.addr(self.region.layout.staging(i)),
                )
            else:
                as_bytes(batch.rows, spec.row_bytes)  # checks the row size
                index = batch.row_index
                if not isinstance(index, torch.Tensor) or index.device != batch.rows.device:
                    index = torch.as_tensor(index, device=batch.rows.device)
                self._gather(batch.rows, index, self._dev.staging[i])
        except BaseException as e:
            # A round whose gathered was stored (by the host round's call, raised past on
            # its way out, or a native launch's enqueued store) is the proxy's: keep it.
            if not (getattr(e, "handed_over", False) or self.end.gathered() == r):
                self.end.unreserve(r)  # never gathered: no hole in the round sequence
            # The callees' frames hold views of the region; a caller keeping this traceback
            # would keep its mapping past close() (memfd.Region.close leaves it to the last view).
            traceback.clear_frames(e.__traceback__)
            raise
        self.sync.signal(r, stream)
        return r, None

    def acked_context(self) -> int:
        """The context the serving proxy's worker named in its HELLO_ACK: the region's
        ``context_tokens`` word (the proxy its one writer, read atomically); 0 while no
        proxy has had one on its connection (``Spec.context_cut``)."""
        return self.end.header.context_tokens

    def acked_round_tokens(self) -> int:
        """The most tokens a round may carry that the serving proxy's worker named in its
        HELLO_ACK: the region's ``round_tokens`` word (as ``context_tokens``); 0 while
        none (``Spec.round_budget``)."""
        return self.end.header.round_tokens

    def _write_device_meta(self, batch: Batch, i: int, deadline_ms: int, context_tokens: int) -> None:
        """Write metadata that lives on the device into descriptor ``i`` in stream order
        (``device_meta.write_meta_in_stream``), with no host sync; the fixed part is the host's.

        Raises:
            ValueError: shapes that disagree, or more entries or tokens than a round holds.
        """
        spec = self.spec
        n = check_meta_shapes(batch, spec.max_slots, spec.sampled)
        self._host[i].desc[:16].view(np.uint32)[:] = (deadline_ms, n, spec.row_bytes, 0)
        write_meta_in_stream(
            batch,
            self._dev.desc[i],
            max_slots=spec.max_slots,
            num_spec=spec.num_spec,
            max_tokens=spec.max_tokens,
            n_out_default=spec.n_out_for(n),
            context_tokens=context_tokens,
            sampled=spec.sampled,
        )

    def round(self, batch: Batch) -> Drafts:
        """The CPU stand-in for the stream's wait: this thread spins ASYNC_SPIN_US, then
        sleeps on the ``released`` futex until a releaser (the proxy, the watchdog, an
        orphan or no-proxy release, close) wakes it; the watchdog bounds it."""
        spec, cfg = self.spec, self.spec.cfg
        n = len(batch)
        serving, resync_all = self._proxy()
        if not serving:
            return empty_drafts(n, spec.num_spec, Outcome.NO_PROXY, cfg.want_margin, spec.sampled)
        t0 = time.monotonic()
        r, released = self._hand_over(batch)
        if spec.device == "cuda":
            if self._launcher is None:  # (the native launch enqueued its wait)
                self.sync.wait(r, 0)
            torch.cuda.current_stream().synchronize()
        elif not released:
            limit_s = self._limit_s
            c0 = time.thread_time()
            released = self.sync.wait(r, limit_s, hold=released is None)  # (the host round spun the hold)
            self.wait_cpu_s += time.thread_time() - c0
            if not released:
                raise RuntimeError(f"round {r} was not released within {limit_s:.3f} s (watchdog {cfg.watchdog_ms} ms)")
        self.max_wait_s = max(self.max_wait_s, time.monotonic() - t0)
        outcome, out = self._answer(r, n)
        self._count_watchdog(outcome)
        out.resync_all = resync_all
        return out

    def _head(self, r: int) -> tuple[Outcome, int, int]:
        """Released round ``r``'s outcome, entry count and flags, from its drafts slot.
        (No view is bound here: a caller keeping the exception must not keep the region.)

        Raises:
            RuntimeError: the slot holds another round (read after it was reused).
        """
        rnd, status, got, flags = self._host[r & (self.spec.depth - 1)].head.tolist()
        if rnd != r:
            raise RuntimeError(
                f"drafts slot {r & (self.spec.depth - 1)} holds round {rnd}, expected {r}: "
                "read after the slot was reused"
            )
        return Outcome(status), got, flags

    def _answer(self, r: int, n: int) -> tuple[Outcome, Drafts]:
        """Released round ``r``'s answer as ``Drafts``: views of its drafts slot, one
        copy per array. Raises as ``_head``."""
        spec = self.spec
        if not (spec.sampled or spec.cfg.want_margin):  # (the C answer copies no margins or distributions)
            return self._host_round.answer(r, n)
        return self._answer_python(r, n)

    def _answer_python(self, r: int, n: int) -> tuple[Outcome, Drafts]:
        """``_answer`` by numpy views of the slot: any answer, and the C answer's reference."""
        spec = self.spec
        outcome, got, flags = self._head(r)
        if not got:  # an empty answer (timeout, error, watchdog, ...)
            return outcome, empty_drafts(n, spec.num_spec, outcome, spec.cfg.want_margin, spec.sampled)
        v = self._host[r & (spec.depth - 1)]
        q = (v.q_ids[:got], v.q_weights[:got]) if flags & memfd.DRAFTS_SAMPLED else None
        return outcome, to_drafts(
            spec.num_spec,
            v.slots(got),
            v.counts[:got],
            v.statuses[:got],
            v.tokens[:got],
            v.margins[:got] if flags & memfd.DRAFTS_MARGINS else None,
            outcome,
            spec.cfg.want_margin,
            clean=True,
            q=q,
        )

    def _count_watchdog(self, outcome: Outcome) -> None:
        """Engine thread: one more round in a row the watchdog answered, or the end of a run."""
        seen = self.watchdog_seen
        self.watchdog_seen = (seen + (time.monotonic(),))[-STALL_ROUNDS:] if outcome is Outcome.WATCHDOG else ()

    def launch(self, batch: Batch, out: tuple[torch.Tensor, ...] = (), status: torch.Tensor | None = None) -> Launched:
        """The round enqueued on the current stream. Its answer goes into ``out`` (device
        tensors shaped as ``drafts.round_tensors`` makes them, contiguous; views of a larger one
        will do), new tensors when none; its outcome into ``status`` (int32 [1] on the
        device), in stream order, when given."""
        spec = self.spec
        n = len(batch)
        resync = ()
        if self._resync:
            resync, self._resync = tuple(sorted(self._resync)), set()
        serving, resync_all = self._proxy()
        out = out or round_tensors(n, spec.num_spec, spec.sampled, self._device)
        if not serving:
            self.counts.record(Outcome.NO_PROXY, np.zeros(0, dtype=np.int32), 0)
            for t in out:
                t.zero_()
            if status is not None:
                status.fill_(int(Outcome.NO_PROXY))
            return Launched(0, *out[:2], resync, False, *(out[2:] or (None, None)))
        stream = streamsync.current_stream(torch)  # once: each lookup costs microseconds
        if self._launcher is not None:  # its wait and its copies of the answer in the same call
            r, _ = self._hand_over(batch, stream, out, status)
        else:
            r, _ = self._hand_over(batch, stream)
            self.sync.wait(r, 0, stream)
            # Copies in stream order (the slot is reused DEPTH rounds later). Every answer
            # leaves the tokens and q blocks zero past each count (ring.geometry, hf_unpack): no mask.
            i, dev = r & (spec.depth - 1), self._dev
            for t, src in zip(out, (dev.tokens[i], dev.counts[i], *(dev.q[i] if spec.sampled else ()))):
                t.copy_(src[:n])
            if status is not None:
                status.copy_(dev.status[i])
        self._pending.append(r)
        return Launched(r, *out[:2], resync, resync_all, *(out[2:] or (None, None)))

    def _collect(self) -> None:
        """Count the outcome of every launched round released by now (engine thread);
        the slots the worker lost are read from the round's own descriptor. No tensor
        is built: one C pass over the drafts slot per round (``HostRound.summary``)."""
        released = self.end.released()
        while self._pending and ring.seq_geq(released, self._pending[0]):
            outcome, drafted, tokens, lost = self._host_round.summary(self._pending.pop(0))
            if lost:
                self._resync.update(lost)
            self.counts.record_totals(outcome, drafted, tokens, len(lost))
            self._count_watchdog(outcome)

    # ------------------------------------------------------------------ closing

    def finish(self) -> None:
        """Closing, on the closing thread, once the proxy is stopped: on CUDA answer what
        the stream still waits for, let it finish, count the last rounds and unpin the
        region here, where torch's context is current."""
        if self.spec.device != "cuda":
            return
        self.end.drain(time.monotonic() + self.spec.cfg.watchdog_ms / 1000.0 + 1.0)
        torch.cuda.synchronize()  # every stream of the device: close() may come from another thread
        self._collect()
        if self._launcher is not None:
            self._launcher.close()  # the stream is done with its kernel
        self.sync.unregister()

    # ------------------------------------------------------------------ statistics

    def link_stats(self) -> LinkStats:
        proxy = self.region.proxy_counters(self.lib).snapshot()
        return LinkStats.of_proxy(proxy.counters, self.end.header.breaker(), self.end.header.link())

    def handoff_stats(self, proxy_thread_alive: bool | None) -> HandoffStats:
        proxy = self.region.proxy_counters(self.lib).snapshot()
        engine = self.region.engine_counters(self.lib).snapshot()
        session, wait_s, gathered, released = (
            self.end.header.session,
            self.max_wait_s,
            self.end.gathered(),
            self.end.released(),
        )
        return HandoffStats.of_region(proxy, engine, session, wait_s, gathered, released, proxy_thread_alive)
