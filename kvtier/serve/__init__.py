"""``kvtier serve``: an OpenAI-compatible HTTP server whose requests decode with a kvtier cache.

- :mod:`.engine`: the wait list, static batches through ``generate``, the generation thread (no HTTP);
- :mod:`.continuous`: continuous batching over one-row caches; :mod:`.scheduler`: its memory decisions;
- :mod:`.text`: incremental detokenisation, stop strings, the ``<think>`` split (no model);
- :mod:`.app`: the FastAPI routes, request validation, SSE; :mod:`.metrics`: ``/metrics``.

Needs the optional extra ``kvtier[serve]`` (fastapi, uvicorn, prometheus-client).
"""

from __future__ import annotations

import logging
import os
import signal

from .continuous import ContinuousEngine
from .engine import Engine, EngineBase, EngineConfig, GenRequest, NeverFits, QueueFull, ShuttingDown

log = logging.getLogger(__name__)


def _uvicorn():
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise ValueError(f"kvtier serve needs the serve extra ({e.name} is missing): pip install 'kvtier[serve]'") from None
    return uvicorn


def make_engine(model, tokenizer, cfg: EngineConfig | None = None) -> EngineBase:
    """The engine ``cfg.scheduler`` names: continuous batching (the default) or static batches."""
    cfg = cfg or EngineConfig()
    return (Engine if cfg.scheduler == "static" else ContinuousEngine)(model, tokenizer, cfg)


def quiet_tokenizer_threads() -> bool:
    """Tell Hugging Face tokenizers not to use their thread pool (``TOKENIZERS_PARALLELISM=false``) unless the user
    said otherwise; returns whether it did.

    Why: the server tokenizes one prompt at a time on its event loop, and each call wakes the tokenizers' Rayon
    pool, whose threads then spin on the cores the decode step's OpenMP threads need. Measured (0.5B bf16, 2-core
    AMX KVM guest, a burst of 32 chat requests): the step that prefilled 22 of them (2,033 tokens) took 3.1 s with
    the pool and 1.65 s without; the burst's last first token came at 4.5 s vs 2.8 s. One prompt gains nothing
    from the pool."""
    if "TOKENIZERS_PARALLELISM" in os.environ:
        return False
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    log.info("TOKENIZERS_PARALLELISM=false: the tokenizers' threads would compete with the decode step's")
    return True


def freeze_startup_objects() -> int:
    """Move every object alive now (the model, its modules and kernels, the libraries' own) out of the cyclic
    garbage collector's reach (``gc.freeze``), after one collection; returns how many.

    Why: a full collection walks every tracked object, ~435,000 once the 0.5B model and the server are loaded: ~140 ms
    on a 2-core Xeon, holding the GIL. The engine collects whenever it falls idle (so that released caches go at
    once) and Python collects on its own now and then; a request arriving then waited for it: one closed-loop client's
    time to first token was ~0.2 s where its ~100-token prefill takes ~0.1. Frozen, those objects are never
    collected (they live as long as the server anyway) and a full collection walks only what was made since."""
    import gc

    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("froze %d startup objects out of the cyclic GC's walk (a full collection no longer visits them)", n)
    return n


def _silent_connections_time_out() -> type:
    """uvicorn's HTTP protocol with its keep-alive timer (``timeout_keep_alive``, 5 s) armed from the moment a
    connection opens, not only after a first response: uvicorn would keep a connection that never sends a request
    open forever, so one client opening thousands of silent ones would take every file descriptor and no one else
    could connect. A request's first bytes disarm it, as they disarm the keep-alive timer."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class SilentConnectionsTimeOut(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if self.timeout_keep_alive_task is None:
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)

    return SilentConnectionsTimeOut


def serve(model, tokenizer, settings, engine_cfg: EngineConfig | None = None, host: str = "127.0.0.1",
          port: int = 8000, grace_s: float = 10.0, on_ready=None) -> None:
    """Run the server until SIGINT/SIGTERM, then shut down gracefully: stop accepting connections, let in-flight
    requests finish for up to ``grace_s`` seconds, cancel the rest, return (exit code 0 for the CLI)."""
    uvicorn = _uvicorn()
    from .app import create_app

    if not settings.api_keys and host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("kvtier serve listens on %s without an API key: anyone who can reach it can use it "
                    "(--api-key or KVTIER_API_KEY)", host)

    quiet_tokenizer_threads()
    engine = make_engine(model, tokenizer, engine_cfg)
    app = create_app(engine, settings)
    app.state.grace_s = grace_s

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # new requests get 503 from the first signal on
            if not self.started:
                # Still starting (preparing the model's step, building kernels): nothing is in flight, and the
                # start-up blocks this thread until it ends, so a flag would be read only then. Stop now.
                log.warning("kvtier serve: %s during start-up; stopping", signal.Signals(sig).name)
                logging.shutdown()
                os._exit(128 + sig)
            app.state.server.draining = True
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets)  # the engine has started: the model and its step are prepared
            freeze_startup_objects()
            if on_ready is not None and not self.should_exit:
                on_ready(self)

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=max(grace_s, 0.1),
                            access_log=False, lifespan="on", http=_silent_connections_time_out())
    # uvicorn re-raises the signal that stopped it once it is done; with these handlers in place beforehand that
    # second delivery is a no-op, so a graceful stop returns normally (exit code 0) instead of dying by the signal
    before = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        _Server(config).run()
    finally:
        for s, h in before.items():
            signal.signal(s, h)


__all__ = ["ContinuousEngine", "Engine", "EngineBase", "EngineConfig", "GenRequest", "NeverFits", "QueueFull", "ShuttingDown", "make_engine",
           "quiet_tokenizer_threads", "serve"]
