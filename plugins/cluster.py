"""Process start-up (entry point ``cluster``): this process's devices and joining a multi-process job.

The cluster environment, as PyTorch Lightning's ``ClusterEnvironment`` plugins are: the core's
``jn.setup_devices(...)`` asks ``jaxnitro_setup_devices`` and ``jn.distributed.initialize(...)``
asks ``jaxnitro_initialize_processes``; this plugin answers both (``trylast``), on JAX's own
runtime:

* :func:`setup_devices`: the host device count (``XLA_FLAGS=--xla_force_host_platform_device_count``,
  which XLA reads once, when JAX's backend starts) and the platform (``jax_platforms``), then
  the backend's local devices, checked against ``n_devs``;
* :func:`initialize`: ``jax.distributed.initialize`` (JAX's multi-controller runtime and its
  coordination service) with the coordinator address checked first
  (:func:`check_coordinator_address`), the host device count, the heartbeat timeout and the
  CPU backend's cross-process collectives.

An installed plugin answering either hook replaces it (one that reads the coordinator from
its scheduler's environment, say). Loading this module touches no device: JAX's backend
starts only when :func:`setup_devices` asks for the devices. Disabled
(``JAXNITRO_DISABLE_PLUGINS=cluster``), ``jn.setup_devices`` and ``jn.distributed.initialize``
raise, naming this plugin; a one-process run on JAX's default devices is unaffected.
"""

from __future__ import annotations

import os
import re

import jax

from jaxnitro.plugin import check_count, hookimpl

__all__ = ["setup_devices", "initialize", "check_coordinator_address", "HOST_DEVICE_FLAG"]

HOST_DEVICE_FLAG = "--xla_force_host_platform_device_count"
"""The XLA flag that sets the number of CPU devices of a process (read when JAX's backend starts)."""


def _set_host_device_count(n: int) -> None:
    """Put ``--xla_force_host_platform_device_count=n`` in ``XLA_FLAGS`` (replacing an earlier one)."""
    flags = re.sub(rf"{HOST_DEVICE_FLAG}=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{HOST_DEVICE_FLAG}={n}"])


def setup_devices(n_devs: int | None = None, backend: str | None = None) -> list:
    """``jn.setup_devices(n_devs, backend)``: make ``n_devs`` devices available; return the
    backend's local devices.

    On a CPU (``backend`` None or ``"cpu"``) it sets the host device count; ``backend`` also
    pins the platform (``jax_platforms``). ``ValueError`` for an ``n_devs`` that is not an
    integer >= 1, ``TypeError`` for a ``backend`` that is not a name, ``RuntimeError`` naming
    the reason and the fix when the process has fewer devices (on a CPU: JAX's backend had
    already started, so the flag could no longer take effect)."""
    if n_devs is not None:
        n_devs = check_count("setup_devices(n_devs=...)", n_devs)
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(f"jaxnitro: setup_devices(backend=...) takes a platform name such as 'cpu', got {backend!r}.")
        jax.config.update("jax_platforms", backend)
    if n_devs is not None and backend in (None, "cpu"):
        _set_host_device_count(n_devs)
    devices = jax.local_devices(backend=backend)
    if n_devs is not None and len(devices) < n_devs:
        platform = devices[0].platform if devices else backend
        cpu = platform == "cpu"
        raise RuntimeError(
            f"jaxnitro: setup_devices(n_devs={n_devs}) but this process has {len(devices)} "
            f"{platform} device(s). "
            + (
                f"JAX's CPU backend had already started before this call (something used JAX "
                f"first: jax.devices(), an array, a jitted call), so the host device count "
                f"({HOST_DEVICE_FLAG}) can no longer change. Call jn.setup_devices({n_devs}) at the top of the "
                f"script, before any other JAX use, or launch Python with "
                f"XLA_FLAGS={HOST_DEVICE_FLAG}={n_devs}."
                if cpu
                else f"Use n_devs <= {len(devices)}, or run on a machine with more devices."
            )
        )
    return devices


def initialize(coordinator_address, num_processes, process_id, local_device_count, heartbeat_timeout_s,
               cpu_collectives, options: dict) -> bool:
    """``jn.distributed.initialize(...)``: ``jax.distributed.initialize`` with ``options`` (its
    other keywords) after the checks and settings jaxnitro adds (see the core function).

    ``ValueError`` for a ``coordinator_address`` that is not ``"host:port"`` (before JAX sees
    it: JAX fails on a missing port with a bare ``IndexError``) or a bad
    ``local_device_count``; JAX's ``RuntimeError`` with jaxnitro's note (initialize must be the
    first JAX call of every process, with the same address and process count)."""
    if coordinator_address is not None:
        check_coordinator_address(coordinator_address)
    if local_device_count is not None:
        _set_host_device_count(check_count("initialize(local_device_count=...)", local_device_count))
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            heartbeat_timeout_seconds=int(heartbeat_timeout_s),
            **options,
        )
    except RuntimeError as err:
        raise RuntimeError(
            f"jaxnitro: jn.distributed.initialize failed: {err}. It must be the first JAX call of "
            f"every process (before jn.setup_devices, jax.devices() or any array), and every process "
            f"needs the same coordinator_address and num_processes."
        ) from err
    return True


def check_coordinator_address(address) -> str:
    """``address`` if it is ``"host:port"`` (``"10.0.0.1:1234"``, ``"node0:1234"``,
    ``"[::1]:1234"``) with a port in 1..65535; else ``ValueError`` naming the address and the fix."""
    example = "jn.distributed.initialize(\"10.0.0.1:1234\", num_processes=2, process_id=0)"
    if not isinstance(address, str):
        raise TypeError(
            f"jaxnitro: jn.distributed.initialize(coordinator_address={address!r}): the address is a "
            f"string \"host:port\" (process 0's host and a free port), e.g. {example}."
        )
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    problem = None
    if not sep or not host or (":" in host and not address.startswith("[")):
        problem = "has no port" if not sep or ":" in host else "has no host"
    elif not port.isdigit() or not 1 <= int(port) <= 65535:
        problem = f"has the port {port!r}, not a number in 1..65535"
    if problem == "has no port" and ":" not in address:
        example = f"jn.distributed.initialize(\"{address}:1234\", num_processes=2, process_id=0)"
    if problem:
        raise ValueError(
            f"jaxnitro: jn.distributed.initialize(coordinator_address={address!r}): the address "
            f"{problem}. It is \"host:port\": process 0's host name or IP and a free TCP port that "
            f"every process can reach (an IPv6 host in brackets, \"[::1]:1234\"), the same in every "
            f"process, e.g. {example}."
        )
    return address


@hookimpl(trylast=True)
def jaxnitro_setup_devices(n_devs, backend):
    return setup_devices(n_devs, backend)


@hookimpl(trylast=True)
def jaxnitro_initialize_processes(coordinator_address, num_processes, process_id, local_device_count,
                                  heartbeat_timeout_s, cpu_collectives, options):
    return initialize(coordinator_address, num_processes, process_id, local_device_count, heartbeat_timeout_s,
                      cpu_collectives, options)
