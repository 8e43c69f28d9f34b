"""The tokenizer process: the HTTP server (uvicorn + the Starlette app) in front of the scheduler.

Reports ready once uvicorn listens; the actual port (api.port may be 0) goes to the supervisor in the info.
SIGTERM makes uvicorn stop accepting and finish open requests within api.shutdown_grace_period.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from typing import IO

import uvicorn
import zmq

from appliance.runtime.bootstrap import Bootstrap
from appliance.runtime.dp_router import make_engine_client
from appliance.runtime.gc_heap import freeze_startup_heap
from appliance.runtime.messages import CONTROL_CODEC, StageReady
from appliance.runtime.process import parent_alive
from appliance.runtime.startup_progress import ProgressWatch, progress_body

log = logging.getLogger("appliance.tokenizer")


def load_server_tokenizer(config) -> object:
    from appliance.config import resolve_model_path
    from appliance.tokenization import load_tokenizer

    m = config.model
    if m.skip_tokenizer_init:  # token ids in, token ids out (server/text.py)
        from appliance.server.text import NoTokenizer

        return NoTokenizer()
    return load_tokenizer(m.tokenizer or resolve_model_path(m.path), mode=m.tokenizer_mode,
                          trust_remote_code=m.trust_remote_code, revision=m.revision, download_dir=m.download_dir)


def bind_http(host: str, port: int) -> socket.socket:
    """Bind the HTTP port first thing, so a port in use fails the start-up at once with a clear message."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def prepare_tokenizer(boot: Bootstrap) -> tuple[object, object, socket.socket]:
    """The slow part (imports, tokenizer files), done while the workers load the model; the port is bound
    before it."""
    config = boot.load_config()
    sock = bind_http(config.api.host, config.api.port)
    import appliance.server.app  # noqa: F401  (import cost paid early)

    return config, load_server_tokenizer(config), sock


def run_tokenizer(boot: Bootstrap, prepared: tuple[object, object, socket.socket], stdin: IO[str]) -> None:
    config, tokenizer, sock = prepared
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(_serve(boot, config, tokenizer, sock, stdin))


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (uvicorn's own choice, `loop="auto"`, which uvicorn applies only
    when it makes the loop itself): every chunk of every stream is a few turns of this loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _serve(boot: Bootstrap, config, tokenizer, sock: socket.socket, stdin: IO[str]) -> None:
    from appliance.observability import FrontendObservability
    from appliance.server.app import StartingGate, build_app
    from appliance.server.context import make_context, served_model_name

    watch = ProgressWatch(boot.addresses.progress) if boot.addresses.progress else None
    gate = StartingGate(lambda: progress_body(watch.latest if watch is not None else None))
    obs = config.observability
    server = uvicorn.Server(uvicorn.Config(
        gate, host=config.api.host, port=config.api.port, log_level=(obs.log_level_http or obs.log_level),
        access_log=obs.enable_log_requests, timeout_graceful_shutdown=config.api.shutdown_grace_period,
        lifespan="off", server_header=False))
    serve = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if serve.done():
            serve.result()  # raises the bind error
            raise RuntimeError(f"HTTP server did not start on {config.api.host}:{config.api.port}")
        await asyncio.sleep(0.02)
    port = sock.getsockname()[1]
    # the heap is mostly built now (imports, tokenizer): collect and freeze it while the workers get ready, so the
    # freeze once ready walks only what came after (it is on the path to /health 200)
    freeze_startup_heap("tokenizer (before its turn)")
    # the port answers 503 while the workers and the scheduler get ready
    await asyncio.to_thread(boot.wait_peers, stdin)
    if watch is not None:
        watch.close()
    sched = boot.peers["scheduler"]
    vocab = int(boot.peers["worker0"].get("vocab_size") or len(tokenizer))
    max_model_len = int(sched["max_model_len"])
    obs = FrontendObservability(config, served_model_name(config), max_model_len)
    engine = make_engine_client(boot.addresses, config, sched.get("max_queued_requests"), obs)  # dp: a router
    engine.start()
    ctx = make_context(config, tokenizer, engine, max_model_len=max_model_len, vocab_size=vocab, obs=obs)
    gate.open(build_app(ctx))
    control = zmq.Context.instance().socket(zmq.PUSH)
    control.setsockopt(zmq.LINGER, 1000)
    control.connect(boot.addresses.control)
    freeze_startup_heap("tokenizer")
    control.send(CONTROL_CODEC.encode(StageReady(boot.name, os.getpid(), {"port": port})))
    log.info("HTTP server on http://%s:%d", config.api.host, port)
    while not serve.done():
        if not parent_alive(boot.parent_pid):  # the supervisor was killed: end open requests with an error now
            engine.fail("the supervisor exited")
            server.should_exit = True
            break
        await asyncio.sleep(0.5)
    await serve
    await engine.close()
    obs.close()
    control.close(0)
