"""``check-config --probe``: ask the configured worker whether it would serve this engine.

From the configuration the engine would start with (:class:`RemoteConfig`) and the sizes
it would say HELLO with (:class:`Sizes`: the engine's own arguments, which no variable
holds), :func:`probe`:

1. resolves the endpoint's host within the connect deadline (``CONNECT_TIMEOUT_MS``): a
   name that does not resolve, or not in time, is reported as such;
2. connects and says HELLO through the engine's own client
   (:class:`~remote_dspark.transport.client.DraftClient`: the same frame, the same key
   proofs, the same checks of the answer), within the same deadline;
3. reads the HELLO_ACK, says BYE, and sets what the worker answered beside what the
   engine is configured with.

The probe's engine id and session are its own, fresh and random (``wire.random_id``). A
worker replaces an engine's windows only for a HELLO of that engine's id, and a
newcomer takes an engine's place only when every place is held and that engine was not
served for a minute (``worker.sessions``: otherwise the newcomer is told "busy"): so a
probe never takes the windows of an engine served within that minute, but on a worker
whose every place is held it is admitted as any newcomer is, in the place of an engine
idle longer (which reconnects and announces its contexts again). Its own session leaves
with its BYE.

The verdict is the worker's: it judges the identities, the vocabulary, its limits, the
key and whether it has room exactly as for the engine. Each row also says which side's
value breaks the other's, so a refusal shows where it comes from.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .. import wire
from ..config.api import RemoteConfig
from ..transport import TransportError
from ..transport.client import AuthFailed, DraftClient, Refused
from ..transport.fleet import ResolveError, system_resolve

Resolver = Callable[..., object]


@dataclass(frozen=True)
class Sizes:
    """What the engine says HELLO with beyond the configuration: its slots, the bytes of
    a row, its drafts per entry and its vocabulary (0: unknown, not checked)."""

    max_slots: int
    row_bytes: int
    num_spec: int
    vocab_size: int = 0


@dataclass(frozen=True)
class ProbeReport:
    """A probe's outcome: ``verdict`` ``"ok"`` or what went wrong (``unresolvable``,
    ``unreachable``, ``identity``, ``vocabulary``, ``limits``, ``busy``, ``key``,
    ``bad answer``, ``mismatch``), ``reason`` in words, and ``rows`` ``(what, engine, worker, clash)``
    where ``clash`` says that the worker's value and the engine's do not go together."""

    verdict: str
    reason: str
    rows: list[tuple[str, str, str, bool]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"


def probe(
    cfg: RemoteConfig,
    sizes: Sizes,
    environ: Mapping[str, str] | None = None,
    resolve: Resolver = socket.getaddrinfo,
) -> ProbeReport:
    """Probe the worker ``cfg`` names (see the module docstring); ``resolve`` is
    ``socket.getaddrinfo`` or a stand-in.

    Raises:
        ValueError: ``sizes`` out of the wire's ranges, naming the value.
    """
    hello = cfg.hello(
        wire.random_id(),
        max_slots=sizes.max_slots,
        row_bytes=sizes.row_bytes,
        num_spec=sizes.num_spec,
        vocab_size=sizes.vocab_size,
    )
    wire.encode_hello(hello, 0)  # the sizes' checks, before anything goes out
    timeout_s = cfg.connect_timeout_ms / 1000
    where = f"{cfg.endpoint.host}:{cfg.endpoint.port}"
    unresolved = _resolve(cfg.endpoint.host, cfg.endpoint.port, timeout_s, resolve)
    if unresolved is not None:
        return ProbeReport("unresolvable", f"{where}: {unresolved}")
    try:
        client = DraftClient.connect(cfg.endpoint, hello, wire.random_id(), timeout_s, environ, key=cfg.key)
    except AuthFailed as e:
        return ProbeReport("key", f"{where}: {e.reason}", _rows(hello, sizes, None, cfg))
    except Refused as e:
        rows = _rows(hello, sizes, e.ack, cfg)
        return ProbeReport(_refusal_kind(e, rows), f"{where} refused the HELLO: {e.reason}", rows)
    except TransportError as e:
        return ProbeReport(
            "unreachable", f"{where}: {e} (within VLLM_DSPARK_REMOTE_CONNECT_TIMEOUT_MS={cfg.connect_timeout_ms})"
        )
    except wire.ProtocolError as e:
        return ProbeReport("bad answer", f"{where}: {e}")
    try:
        rows = _rows(hello, sizes, client.ack, cfg)
    finally:
        client.close()  # BYE: the worker lets the probe's session go
    clashes = [what for what, _, _, clash in rows if clash]
    if clashes:  # the worker judges all of these: only a worker of other rules gets here
        return ProbeReport("mismatch", f"{where} accepted, but {', '.join(clashes)} do not match", rows)
    return ProbeReport("ok", f"{where} accepts this engine", rows)


def _resolve(host: str, port: int, timeout_s: float, resolve: Resolver) -> str | None:
    """Why ``host`` does not resolve within ``timeout_s``, or None: the engine's own
    bounded look-up (:func:`~remote_dspark.transport.fleet.system_resolve`) with
    ``resolve`` as its ``getaddrinfo``."""
    try:
        system_resolve(host, port, timeout_s, getaddrinfo=resolve)
    except ResolveError as e:
        return f"{e} (VLLM_DSPARK_REMOTE_CONNECT_TIMEOUT_MS)" if e.timed_out else str(e)
    return None


def _refusal_kind(e: Refused, rows: list[tuple[str, str, str, bool]]) -> str:
    if e.code == wire.REFUSE_AUTH:
        return "key"
    if e.reason.startswith("busy"):
        return "busy"
    clashes = {what for what, _, _, clash in rows if clash}
    if clashes & {"drafter identity", "Markov identity"}:
        return "identity"
    if "vocab_size" in clashes:
        return "vocabulary"
    return "limits"


def _rows(hello: wire.Hello, sizes: Sizes, ack: wire.HelloAck | None, cfg: RemoteConfig) -> list:
    """The rows of a report: each HELLO field beside the worker's answer to it."""
    rounds = wire.round_sections(sizes.max_slots, 0, sizes.row_bytes, hello.want_sampled).size
    key = cfg.key.path if cfg.key is not None else "none"
    if ack is None:
        return [("key", key, "did not prove it holds the key", True)]
    vocab = str(sizes.vocab_size) if sizes.vocab_size else "unknown (--vocab-size): not checked"
    return [
        (
            "drafter identity",
            hello.drafter_identity.hex(),
            ack.drafter_identity.hex(),
            ack.drafter_identity != hello.drafter_identity,
        ),
        (
            "Markov identity",
            hello.markov_identity.hex(),
            ack.markov_identity.hex(),
            ack.markov_identity != hello.markov_identity,
        ),
        (
            "vocab_size",
            vocab,
            str(ack.vocab_size or "unknown"),
            bool(sizes.vocab_size and ack.vocab_size > sizes.vocab_size),
        ),
        ("max_slots", str(sizes.max_slots), f"at most {ack.max_slots}", sizes.max_slots > ack.max_slots),
        ("row_bytes", str(sizes.row_bytes), f"at most {ack.max_row_bytes}", sizes.row_bytes > ack.max_row_bytes),
        ("a round's rows (bytes)", str(rounds), f"at most {ack.max_round_bytes}", rounds > ack.max_round_bytes),
        ("num_spec", str(sizes.num_spec), "-", False),
        ("context_tokens", "-", str(ack.context_tokens), False),
        ("round_tokens", "-", str(ack.round_tokens), False),
        ("engines served", "-", str(ack.engines), False),  # its load: engines now, spares and this probe left out
        ("incarnation", "-", f"{ack.incarnation:016x}", False),  # new at every worker start
        ("key", key, "refused" if ack.code == wire.REFUSE_AUTH else "-", ack.code == wire.REFUSE_AUTH),
    ]


def spell(report: ProbeReport) -> str:
    """The report as a table (FIELD, ENGINE, WORKER, and ``<-`` on a clash) and its verdict line."""
    head = [("FIELD", "ENGINE", "WORKER", "")]
    rows = head + [
        (what, engine, worker, "<- mismatch" if clash else "") for what, engine, worker, clash in report.rows
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}".rstrip() for a, b, c, d in rows]
    verdict = "ok" if report.ok else f"FAILED ({report.verdict})"
    return "\n".join((lines if report.rows else []) + [f"probe: {verdict}: {report.reason}"])


def as_json(report: ProbeReport) -> dict:
    """The report as one JSON object: ``ok``, ``verdict``, ``reason`` and ``fields``,
    each ``{"engine", "worker", "mismatch"}``."""
    return {
        "ok": report.ok,
        "verdict": report.verdict,
        "reason": report.reason,
        "fields": {w: {"engine": e, "worker": k, "mismatch": c} for w, e, k, c in report.rows},
    }
