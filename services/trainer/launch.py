"""How the trainer's ranks start: torchrun's arguments for one node or many, and what is refused
before any rank starts.

    one node:   torchrun --standalone --nproc-per-node P -m services.trainer ...
    many nodes: torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT
                         --rdzv-id RUN_ID -m services.trainer ...      (the same command on every node)

On many nodes the c10d rendezvous is served by the torchrun whose host is the endpoint's host;
ranks are numbered in the order of the nodes' names, so rank 0 (the REST API and the control
plane) runs on the node whose name sorts first, and registers its URL like every service does.
Every node sees the same ``run.output_dir`` (shared storage): checkpoints are written there by
every rank, and a restart at another node count reshards them on load.
"""

from __future__ import annotations

import socket

from shared.config_error import ConfigError
from shared.netaddr import host_port, reach
from shared.run_config import RunConfig


def launcher(cfg: RunConfig) -> list[str]:
    """torchrun's arguments (after the interpreter) for this trainer's layout."""
    t = cfg.trainer
    args = ["-m", "torch.distributed.run", f"--nproc-per-node={t.nproc_per_node}"]
    if t.nnodes == 1:
        return [*args, "--standalone"]
    assert t.rdzv_endpoint is not None  # preflight refused it
    return [
        *args,
        f"--nnodes={t.nnodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={t.rdzv_endpoint}",
        f"--rdzv-id={cfg.run.run_id}",
        f"--rdzv-conf=join_timeout={max(1, int(t.rdzv_timeout_s))}",
        "--max-restarts=0",  # a rank that dies ends the trainer; the run resumes from its checkpoint
    ]


def _is_local(host: str) -> bool:
    """Whether ``host`` names an address of this host (a socket can bind it)."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((address[0], 0))
                return True
            except OSError:
                continue
    return False


def preflight(cfg: RunConfig, world_size: int, *, launched: bool) -> None:
    """Refuse, naming the key, a node count without a rendezvous and a world the backend's parallel
    layout does not divide; on a node other than the rendezvous's own, wait (up to
    ``trainer.rdzv_timeout_s``) until the endpoint answers, else `shared.netaddr.Unreachable`
    naming the endpoint and this host."""
    t = cfg.trainer
    if t.nnodes < 1 or t.nproc_per_node < 1:
        raise ConfigError(f"trainer.nnodes ({t.nnodes}) and trainer.nproc_per_node ({t.nproc_per_node}) must be >= 1")
    if t.nnodes > 1 and not t.rdzv_endpoint:
        raise ConfigError(
            f"trainer.rdzv_endpoint is required with trainer.nnodes {t.nnodes}: HOST:PORT of a free port on one "
            "of the trainer's nodes (its c10d rendezvous)"
        )
    if world_size > 1 and cfg.trainer.backend == "megatron":
        from services.trainer.backends.megatron_setup import check_supported

        check_supported(cfg.policy, world_size)
    if t.nnodes > 1 and not launched:
        assert t.rdzv_endpoint is not None
        try:
            host, port = host_port(t.rdzv_endpoint, default_port=29400)
        except ValueError as exc:
            raise ConfigError(f"trainer.rdzv_endpoint: {exc}") from None
        if not _is_local(host):
            reach(host, port, what="the trainer's rendezvous (trainer.rdzv_endpoint)", deadline_s=t.rdzv_timeout_s)
