"""Which weights a server runs, as the version its route sessions follow, and the HTTP weight sync.

A session's delta is only valid between turns served with the same weights: the rows a client
holds for its history were computed by the weights of their turn, and after a weight sync the
engine computes the whole prompt again with the new ones (its prefix cache is reset). So every
session turn records the version it ran with (:mod:`auxout.vllm.server.sessions`), and a turn
under another version starts at 0. The version is the digest of the weights the engine's workers
run (``auxout_weights_version``, the digest auxout keys a generation's routes by), so replicas
that loaded the same weights agree on it, however and whenever they got them: during a rolling
sync a session moving between synced and not-yet-synced replicas restarts at 0 on each switch of
weights, and continues with deltas once both run the same.

``POST /auxout/update_weights`` (:func:`router`, with ``VLLM_SERVER_DEV_MODE=1`` like vLLM's own
``/pause``, ``/collective_rpc`` and ``/reset_prefix_cache``) syncs one replica in place, so that no
turn straddles two versions:

1. new session turns wait; those in flight finish (``drain_timeout`` seconds at most, else 503);
2. vLLM's ``pause_generation(mode="wait")`` lets every other request in flight finish and queues
   new ones;
3. each worker reads ``weights_path`` (a safetensors file, or a directory of them as
   ``save_pretrained`` writes, in transformers' or the checkpoint's names), checks names and shapes
   against the checkpoint it loaded (400 before anything is touched) and loads them
   (:func:`auxout.vllm.weight_sync.load_path_on_worker`);
4. the prefix cache is reset and the new version read (and set as vLLM's own weight version, which
   ``GET /weight_info`` returns); generation resumes, waiting turns go on.

A reset done another way (vLLM's ``/reset_prefix_cache``, ``/collective_rpc``, ``/resume``,
``/wake_up``) marks the version unknown, and the next session turn reads it again; only the
endpoint above also keeps turns from straddling the change.
"""

# (no ``from __future__ import annotations``: FastAPI reads the route handlers' annotations at runtime)
import asyncio
import functools
import hashlib
import logging
import time
from typing import Any

from auxout.vllm.server.body_checks import error_body

logger = logging.getLogger("vllm.auxout")

VERSION_METHOD = "auxout_weights_version"
"""auxout worker method: the digest of the weights that worker runs."""
LOAD_PATH_METHOD = "auxout_load_weights_path"
"""auxout worker method: load a safetensors file or directory in place (``load_path_on_worker``)."""
SYNC_PATH = "/auxout/update_weights"
DEFAULT_DRAIN_TIMEOUT = 300.0


class WeightsVersion:
    """The version of the weights this server runs, and a gate that keeps session turns from
    straddling a weight sync (turns enter and leave; a sync waits for none to be in flight)."""

    def __init__(self) -> None:
        self.value: str | None = None  # (None: unknown, read at the next session turn)
        self.syncs = 0
        self._turns = 0
        # (asyncio binds these to the server's loop when first waited on, not here)
        self._reading = asyncio.Lock()
        self._idle = asyncio.Event()  # set while no session turn is in flight
        self._open = asyncio.Event()  # set while no sync runs
        self._idle.set()
        self._open.set()

    def mark_unknown(self) -> None:
        self.value = None

    async def current(self, engine: Any) -> str:
        """The version, read from the workers when unknown ("" if they cannot say: sessions then
        follow no version, as before any sync)."""
        async with self._reading:
            if self.value is None:
                try:
                    digests = await engine.collective_rpc(VERSION_METHOD)
                except Exception as exc:  # (a worker without the method: not auxout's)
                    logger.warning("auxout: could not read the weights version (%s: %s)", type(exc).__name__, exc)
                    digests = [""]
                self.value = _combine([str(d) for d in digests or [""]])
            return self.value

    async def enter_turn(self, engine: Any) -> str:
        """Start a session turn (after any sync in progress) and return the version it runs."""
        while not self._open.is_set():
            await self._open.wait()
        self._turns += 1
        self._idle.clear()
        try:
            return await self.current(engine)
        except BaseException:
            self.leave_turn()
            raise

    def leave_turn(self) -> None:
        self._turns -= 1
        if self._turns == 0:
            self._idle.set()

    async def sync(self, engine: Any, weights_path: str, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT) -> dict[str, Any]:
        """Load ``weights_path`` into every worker with no turn straddling it (module docstring);
        returns the new version with what was loaded. ``SyncError`` (with its HTTP status) else."""
        if not self._open.is_set():
            raise SyncError(409, "another weight sync of this server is in progress")
        began = time.perf_counter()
        self._open.clear()
        try:
            try:
                await asyncio.wait_for(self._idle.wait(), drain_timeout)
            except TimeoutError:
                raise SyncError(503, f"{self._turns} route session turn(s) still in flight after {drain_timeout:g} s "
                                     "(drain_timeout): nothing was loaded; retry") from None  # fmt: skip
            await engine.pause_generation(mode="wait", clear_cache=False)
            touched = False
            try:
                try:
                    results = await engine.collective_rpc(LOAD_PATH_METHOD, args=(weights_path,))
                except Exception as exc:  # (a failure inside vLLM's reload: the weights may have changed in part)
                    touched = True
                    raise SyncError(500, f"loading {weights_path} failed: {type(exc).__name__}: {exc}") from None
                refused = [r["error"] for r in results if isinstance(r, dict) and "error" in r]
                if refused:  # (checked on every worker before it loads: nothing touched)
                    raise SyncError(400, refused[0])
                touched = True
            finally:
                try:
                    reset = await engine.reset_prefix_cache() if touched else True
                finally:
                    await engine.resume_generation()
                if touched:
                    self.value = None
                    version = await self.current(engine)  # (session turns still wait for it)
                    label = getattr(engine, "update_weight_version", None)
                    if label is not None:  # (vLLM's own weight version, GET /weight_info, says the same)
                        await label(version)
            if not reset:
                raise SyncError(500, "the weights are loaded but vLLM refused to reset the prefix cache")
        finally:
            self._open.set()
        self.syncs += 1
        first = results[0]
        return {
            "weights_version": version,
            "num_tensors": int(first["num_tensors"]),
            "moe_layers_repacked": int(first["moe_layers_repacked"]),
            "seconds": round(time.perf_counter() - began, 3),
        }


class SyncError(RuntimeError):
    """A weight sync refused or failed; ``status``: its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _combine(digests: list[str]) -> str:
    """One version from each worker's digest (tensor-parallel ranks hold different shards)."""
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256("|".join(digests).encode()).hexdigest()[:16]


def install(version: WeightsVersion) -> None:
    """Follow the weights in this API-server process: ``version`` marked unknown after every engine
    call that may change them, and ``POST /auxout/update_weights`` served (dev mode)."""
    _mark_unknown_on_change(version)
    _add_router(version)


def _mark_unknown_on_change(version: WeightsVersion) -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    if getattr(AsyncLLM.reset_prefix_cache, "_auxout", False):
        return
    for name in ("reset_prefix_cache", "resume_generation", "wake_up", "collective_rpc", "update_weights"):
        original = getattr(AsyncLLM, name, None)
        if original is None:
            continue

        @functools.wraps(original)
        async def marked(self: Any, *args: Any, __orig: Any = original, __name: str = name, **kwargs: Any) -> Any:
            result = await __orig(self, *args, **kwargs)
            method = kwargs.get("method", args[0] if args else None)
            if __name != "collective_rpc" or method != VERSION_METHOD:
                version.mark_unknown()
            return result

        marked._auxout = True  # type: ignore[attr-defined]
        setattr(AsyncLLM, name, marked)


def router(version: WeightsVersion) -> Any:
    """The FastAPI router of ``POST /auxout/update_weights``."""
    from fastapi import APIRouter, Request
    from fastapi.responses import JSONResponse

    api = APIRouter()

    @api.post(SYNC_PATH)
    async def update_weights(raw_request: Request) -> JSONResponse:
        try:
            body = await raw_request.json()
        except ValueError as exc:
            return _error(400, f"the body is not JSON: {exc}", None)
        if not isinstance(body, dict):
            return _error(400, f"the body must be a JSON object, got {type(body).__name__}", None)
        unknown = sorted(set(body) - {"weights_path", "drain_timeout"})
        if unknown:
            return _error(400, f"unknown field(s) {unknown}; known: drain_timeout, weights_path", unknown[0])
        path = body.get("weights_path")
        if not isinstance(path, str) or not path:
            return _error(400, f"weights_path must be a non-empty string (a safetensors file or a directory of "
                               f"them, on the server's machine), got {path!r:.200}", "weights_path")  # fmt: skip
        servers = int(getattr(raw_request.app.state.args, "api_server_count", None) or 1)
        if servers > 1:  # (the other API servers would neither hold their turns back nor see the change)
            return _error(400, f"a weight sync over HTTP needs one API server, this replica runs {servers} "
                               "(--api-server-count)", None)  # fmt: skip
        timeout = body.get("drain_timeout", DEFAULT_DRAIN_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < float("inf"):
            return _error(400, f"drain_timeout must be a positive number of seconds, got {timeout!r:.80}",
                          "drain_timeout")  # fmt: skip
        try:
            result = await version.sync(raw_request.app.state.engine_client, path, float(timeout))
        except SyncError as exc:
            return _error(exc.status, str(exc), "weights_path" if exc.status == 400 else None)
        logger.info("auxout: weights synced from %s: version %s (%d tensors, %.2f s)", path,
                    result["weights_version"], result["num_tensors"], result["seconds"])  # fmt: skip
        return JSONResponse(result)

    @api.get("/auxout/weights_version")
    async def weights_version(raw_request: Request) -> JSONResponse:
        value = await version.current(raw_request.app.state.engine_client)
        return JSONResponse({"weights_version": value, "syncs": version.syncs})

    return api


def _error(status: int, message: str, param: str | None) -> Any:
    from fastapi.responses import Response

    return Response(error_body(message, param, status), status_code=status, media_type="application/json")


def _add_router(version: WeightsVersion) -> None:
    """Add :func:`router` to the app vLLM's server builds (with ``VLLM_SERVER_DEV_MODE=1``)."""
    import vllm.entrypoints.launchers.app as app_module
    from vllm import envs

    original = app_module.register_api_routers
    if getattr(original, "_auxout", False):
        return

    @functools.wraps(original)
    def register_api_routers(args: Any, app: Any, *rest: Any, **kwargs: Any) -> Any:
        result = original(args, app, *rest, **kwargs)
        if envs.VLLM_SERVER_DEV_MODE:
            app.include_router(router(version))
        return result

    register_api_routers._auxout = True  # type: ignore[attr-defined]
    app_module.register_api_routers = register_api_routers
