"""Reaching a Ray cluster for `executor: ray`: a new local one, or one given by address,
failing in seconds (exit 3, with the reason) where nothing answers."""

from __future__ import annotations

import logging
import re
import socket

from vlbatch.errors import JobCannotRunError

log = logging.getLogger("vlbatch")
# every Ray process a run starts: NVLink multicast off (shared/device/README.md)
WORKER_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
              "NVSHMEM_DISABLE_NVLS": "1", "VLLM_NO_USAGE_STATS": "1"}
CONNECT_TIMEOUT_S = 10  # an explicit address: how long to wait for its port to answer


def connect(address: str | None):
    """Ray, started here (address None: a new local cluster, never one that happens to be
    running, nor RAY_ADDRESS's) or joined; the run's processes get WORKER_ENV."""
    try:
        import ray
    except ImportError:
        raise JobCannotRunError("executor: ray needs Ray: pip install 'vlbatch[ray]'") from None
    if ray.is_initialized():
        return ray, False
    if address:
        check_listening(address, bootstrap_address(address))
    debug = log.isEnabledFor(logging.DEBUG)
    try:
        ray.init(address=address or "local", runtime_env={"env_vars": WORKER_ENV}, log_to_driver=debug,
                 include_dashboard=False, logging_level=logging.DEBUG if debug else logging.WARNING)
    except (Exception, SystemExit) as e:  # Ray exits when it gives up on an address
        raise JobCannotRunError(f"cannot reach the Ray cluster at {address or 'a new local one'}: "
                                f"{root_cause(e)}") from None
    if not debug:  # Ray's console chatter only with --debug: vlbatch reports progress itself
        import ray.data  # noqa: F401 - sets up Ray Data's loggers, whose console we quieten

        logging.getLogger("ray").setLevel(logging.ERROR)
        for handler in logging.getLogger("ray.data").handlers:
            if not isinstance(handler, logging.FileHandler):  # its log file stays complete
                handler.setLevel(logging.ERROR)
    return ray, True


def bootstrap_address(address: str) -> str:
    """Where Ray will connect for `address`: for "auto", the cluster Ray finds itself
    (RAY_ADDRESS, else the last `ray start` on this machine, recorded in Ray's temp folder,
    which outlives a stopped cluster); any other address as given. Where Ray cannot say,
    "auto" stays, and Ray reports the problem itself."""
    if address != "auto":
        return address
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address("auto") or address
    except Exception:  # no cluster found (Ray's own error is clear and quick), or Ray moved it
        return address


def check_listening(address: str, resolved: str | None = None,
                    timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A cluster address (host:port, ray://host:port; `resolved` is where "auto" led) where
    nothing listens fails in seconds, not after Ray's retries (2 to 10 minutes, measured)."""
    target = resolved or address
    found = re.fullmatch(r"(?:ray://)?\[?([^\]\s]+?)\]?:(\d+)", target.strip())
    if found is None:
        return
    host, port = found[1], int(found[2])
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        via = f" (where {address!r} leads)" if target != address else ""
        raise JobCannotRunError(f"cannot reach the Ray cluster at {target}{via}: nothing answers "
                                f"at {host}:{port} within {timeout_s:g} s ({e})") from None


def root_cause(error: BaseException) -> str:
    """The innermost 'SomeError: message' line of a Ray error (which wraps the actor's or
    task's own traceback), else its first line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    causes = re.findall(r"^\s*(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$", text, re.M)
    if causes:
        name, message = causes[-1]
        return f"{name}: {message.strip()}"
    lines = text.strip().splitlines()
    return lines[0] if lines else type(error).__name__
