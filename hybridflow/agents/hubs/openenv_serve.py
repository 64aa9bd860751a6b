"""The OpenEnv server process a run starts (hybridflow/agents/hubs/openenv_server.py):

    python -m hybridflow.agents.hubs.openenv_serve <package.module:app | path/to/env.py:MyEnvironment>
        --host 127.0.0.1 --port N --max-sessions M

An app is served as it is; an Environment class through openenv's own `create_fastapi_app` with
`max_concurrent_envs=M`, its `reset` and `step` wrapped so that an exception they raise is printed
with its traceback into the server's log before openenv turns it into an error message (its
WebSocket answers only the exception's text), so a run stopped by failing environment steps shows
the environment's own traceback. It exits by itself when the process that started it is gone.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import sys
import threading
import time
import traceback

from hybridflow.agents.hubs.openenv_server import environment_types
from hybridflow.registry import load_object


def logged(cls: type) -> type:
    """A subclass of the Environment class whose reset and step (and their async forms, where the class
    has its own) print the traceback of what they raise, then raise it."""
    from openenv.core import Environment

    def wrap(method):
        if inspect.iscoroutinefunction(method):
            @functools.wraps(method)
            async def call_async(self, *args, **kwargs):
                try:
                    return await method(self, *args, **kwargs)
                except Exception:
                    traceback.print_exc(file=sys.stderr)
                    sys.stderr.flush()
                    raise
            return call_async

        @functools.wraps(method)
        def call(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception:
                traceback.print_exc(file=sys.stderr)
                sys.stderr.flush()
                raise
        return call

    names = ["reset", "step"] + [n for n in ("reset_async", "step_async")
                                  if getattr(cls, n) is not getattr(Environment, n)]
    return type(cls.__name__, (cls,), {"__module__": cls.__module__, **{n: wrap(getattr(cls, n)) for n in names}})


def quiet_disconnects(app):
    """The app, less the traceback openenv 0.3.0 logs for every WebSocket whose client had gone when the
    session ended (its handler closes the socket again and that raises): a client that leaves, or a
    connection the server's shutdown ends, is no error."""
    from starlette.websockets import WebSocketDisconnect

    async def asgi(scope, receive, send):
        try:
            await app(scope, receive, send)
        except WebSocketDisconnect:
            if scope.get("type") != "websocket":
                raise

    return asgi


def build_app(target: str, max_sessions: int):
    obj = load_object(target)  # first: what the target prints while it loads is the log's first lines

    from openenv.core import Environment, create_fastapi_app

    if inspect.isclass(obj) and issubclass(obj, Environment):
        action, observation = environment_types(obj)
        return create_fastapi_app(logged(obj), action, observation, max_concurrent_envs=max_sessions)
    return obj


def exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    """Ends this process once the run that started it is gone (a driver killed by SIGKILL has no
    `finally` to stop its server; the server, in a process group of its own, would outlive it)."""
    while True:
        time.sleep(every_s)
        if os.getppid() != parent:
            print(f"openenv_serve: the run (pid {parent}) is gone; exiting", flush=True)
            os._exit(0)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-sessions", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"openenv_serve: {args.target} on {args.host}:{args.port}", flush=True)
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True, name="exit-with-parent").start()
    uvicorn.run(quiet_disconnects(build_app(args.target, args.max_sessions)), host=args.host, port=args.port, log_level="info",
                ws_ping_interval=None)


if __name__ == "__main__":
    main()
