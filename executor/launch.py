"""Starting the ranks: torch's elastic launcher (what torchrun runs), or in-process under torchrun.

`run_plan(plan, run, launch)` first checks the plan against `costmodel.plan_rules` (what torch would
refuse fails here, as one `error:` line, before any worker starts) and against this host
(`executor.preflight.check_host`: a GPU plan without a GPU, more ranks than the node, memory); then:
- under an external torchrun (RANK, WORLD_SIZE and LOCAL_RANK set) this process is one rank: it joins
  the process group from the environment and trains;
- otherwise it launches `nnodes x nproc_per_node` workers with `elastic_launch(LaunchConfig(...))`, with
  torchrun's semantics: one node and no rendezvous endpoint is `--standalone` (a c10d store on a free
  local port); otherwise the given rendezvous backend (torchrun's default `static`, at
  `--rdzv-endpoint` or `--master-addr:--master-port`, with this node's `--node-rank`). On a CUDA host the
  agent spawns the ranks, as torchrun does; on a CPU host it forks them from a forkserver that imported
  the executor once (`start_method`), each with the launching process's environment of the moment.
A worker that raises writes its traceback into a per-launch log directory; the parent turns the
group's failure into one line (`worker_failure`: the rank, its exception's message, the log file with
every rank's traceback), and torch's elastic loggers stay quiet unless `LaunchOptions.debug`.
The backend is NCCL when CUDA is present, else gloo. Rank 0's `RunResult` comes back as a dict.
Every worker group joins its process group through a store no earlier group wrote to, so a group
restarted after a failure (`--max-restarts`) or re-formed after nodes left or joined never reads its
predecessor's gloo addresses: with a c10d rendezvous (`--rdzv-backend c10d`, `--elastic`, one node) each
rendezvous round gets a fresh store (`fresh_store_per_round`); with the static one, the agent's store
outlives the group and each attempt gets its own key prefix (`attempt_store`).
No hangs: the process group's timeout and each worker's `executor.watchdog.Watchdog` come from the
plan's predicted step time (or `RunConfig.timeout_s`, `--timeout`); a rank that stops making progress
records what it waited on (`end_stalled_rank`) and exits, the elastic agent stops the other ranks (the
launcher's `--max-restarts` apply), and the parent reports the rank's line.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from costmodel.plan_rules import check_pipeline
from executor.preflight import check_host, check_world_size
from planner.plan import Plan, plan_from_dict
from tracer.errors import SoapError

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

QUIET_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
"""torch's loggers that print a failed worker group's tracebacks (`E1123 ... elastic/...` lines)."""


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """torchrun's launch flags."""

    nproc_per_node: int | None = None
    """Workers on this node; default: the plan's world size divided by the node count."""
    nnodes: str = "1"
    """Node count, `N` or `MIN:MAX` (elastic)."""
    node_rank: int = 0
    """This node's rank (static rendezvous)."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the rendezvous; default `master_addr:master_port`."""
    rdzv_backend: str = "static"
    """`static` or `c10d` (or any backend torch's elastic agent knows)."""
    rdzv_id: str | None = None
    """Job id shared by all nodes; default a random one on a single node."""
    max_restarts: int = 0
    """Restarts of the worker group after a failure."""
    rdzv_conf: str = ""
    """torchrun's `--rdzv-conf`: `key=value,...` for the rendezvous backend (e.g. `last_call_timeout=5`: how
    long a c10d round waits for more nodes once MIN have joined; torch's default is 30 s)."""
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    debug: bool = False
    """Let torch's elastic logs (and their tracebacks) reach the terminal."""
    allow_cpu: bool = False
    """Run a GPU plan on CPU processes (gloo) when this host has no GPU: a smoke run (`executor.preflight`)."""
    replan: Callable[[Plan, int], Plan] | None = None
    """Elastic runs (`--elastic`): called in each worker, as `replan(plan, world_size)`, when the rendezvous
    formed a world of another size than the plan's (nodes left or joined); the workers then run its plan and
    resume from the newest checkpoint. A top-level function (it is pickled by reference into the workers);
    the executor never searches, so the caller (soap's façade, `soap.elastic`) brings it. None: a world of
    another size is refused."""


def under_torchrun() -> bool:
    return all(key in os.environ for key in TORCHRUN_ENV)


def node_counts(nnodes: str) -> tuple[int, int]:
    try:
        low, _, high = nnodes.partition(":")
        result = int(low), int(high or low)
    except ValueError:
        raise SoapError(f"--nnodes {nnodes!r}: expected N or MIN:MAX") from None
    if result[0] < 1 or result[1] < result[0]:
        raise SoapError(f"--nnodes {nnodes!r}: need 1 <= MIN <= MAX")
    return result


def rdzv_configs(text: str) -> dict[str, str]:
    """`key=value,...` as a dict (torchrun parses `--rdzv-conf` the same way)."""
    pairs = [item.partition("=") for item in text.split(",") if item.strip()]
    if any(not key.strip() or not sep for key, sep, _ in pairs):
        raise SoapError(f"--rdzv-conf {text!r}: expected key=value,...")
    return {key.strip(): value.strip() for key, _, value in pairs}


def check_plan_rules(plan: Plan) -> None:
    """Refuse, before any worker starts, a plan torch would refuse (`costmodel.plan_rules`): plan.json
    is validated on load, but a `Plan` built in Python may skip that."""
    from executor.cross_entropy import check_cross_entropy

    p = plan.parallelism
    check_pipeline(p.schedule, pp=p.pp, virtual_stages=p.virtual_stages, num_microbatches=p.num_microbatches,
                   grad_accum=p.grad_accum, zero=p.zero)
    check_cross_entropy(p.cross_entropy)


def run_plan(plan: Plan, run: Any, launch: LaunchOptions) -> dict[str, Any] | None:
    """Train `plan` on all ranks; returns rank 0's result dict (None on other ranks and nodes)."""
    nproc, min_nodes, max_nodes = preflight(plan, launch)
    if under_torchrun():
        return _worker(plan.to_json(), run)
    return _elastic(plan, run, launch, nproc, min_nodes, max_nodes)


def preflight(plan: Plan, launch: LaunchOptions) -> tuple[int, int, int]:
    """Every check that needs no worker, as `error:` lines: the plan's rules, the launch flags and this host
    (`executor.preflight`); returns (ranks on this node, min nodes, max nodes). `soap execute` runs it
    before anything slow (tokenizing a dataset), `run_plan` again before it starts the ranks."""
    check_plan_rules(plan)
    if under_torchrun():
        check_world_size(plan, int(os.environ["WORLD_SIZE"]))
        check_host(plan, nproc_per_node=None, nnodes=1, allow_cpu=launch.allow_cpu, under_torchrun=True)
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1, 1
    min_nodes, max_nodes = node_counts(launch.nnodes)
    rdzv_configs(launch.rdzv_conf)
    if min_nodes != max_nodes and plan.world_size % min_nodes and launch.replan is None:
        raise SoapError(f"elastic --nnodes {launch.nnodes}: the plan's {plan.world_size} ranks are fixed; "
                        "pass a fixed node count")
    if launch.nproc_per_node is not None and launch.nproc_per_node < 1:
        raise SoapError(f"--nproc-per-node {launch.nproc_per_node}: need at least 1 worker per node")
    nproc = launch.nproc_per_node or max(1, plan.world_size // max_nodes)
    check_world_size(plan, nproc * max_nodes)
    check_host(plan, nproc_per_node=launch.nproc_per_node, nnodes=max_nodes, allow_cpu=launch.allow_cpu)
    return nproc, min_nodes, max_nodes


def _elastic(plan: Plan, run: Any, launch: LaunchOptions, nproc: int, min_nodes: int,
             max_nodes: int) -> dict[str, Any] | None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    standalone = max_nodes == 1 and launch.rdzv_endpoint is None
    backend = "c10d" if standalone else launch.rdzv_backend
    endpoint = "localhost:0" if standalone else (launch.rdzv_endpoint or f"{launch.master_addr}:{launch.master_port}")
    configs: dict[str, Any] = {"rank": launch.node_rank} if backend == "static" else {}
    configs.update(rdzv_configs(launch.rdzv_conf))
    method = start_method(plan)
    config = LaunchConfig(
        min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc,
        run_id=launch.rdzv_id or (uuid.uuid4().hex if standalone else "none"),
        rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_configs=configs,
        max_restarts=launch.max_restarts, monitor_interval=0.1, start_method=method,
    )
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    log_dir = Path(tempfile.mkdtemp(prefix="soap-workers-"))
    try:
        with _quiet_torch_logs(enabled=not launch.debug), fresh_store_per_round(enabled=backend != "static"):
            environ = dict(os.environ) if method == "forkserver" else None
            results = elastic_launch(config, _worker)(plan.to_json(), run, str(log_dir), launch.replan, environ)
    except ChildFailedError as exc:
        raise SoapError(worker_failure(exc.failures, log_dir)) from None
    shutil.rmtree(log_dir, ignore_errors=True)
    result = results.get(0)
    if isinstance(result, dict) and "error" in result:
        raise SoapError(result["error"])
    return result


@contextlib.contextmanager
def fresh_store_per_round(*, enabled: bool) -> Iterator[None]:
    """Give each c10d rendezvous round's worker group a store of its own (torch's
    `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, read by the agent while it runs): rank 0's agent publishes a
    free port under the round's key prefix and rank 0's worker hosts a new TCPStore there.

    By default the agent shares one TCPStore with every worker group of the job, and nothing the workers
    see names the group: `TORCHELASTIC_RESTART_COUNT` is each agent's own count of failed groups, and a
    group an agent stops because nodes left or joined ("membership changes do not count as retries") does
    not advance it. After a node is lost one survivor may restart by membership (count 0) while the others
    restart after their worker failed (count 1), so no per-attempt key prefix is the same on every node:
    the new group either waits forever on keys under another prefix, or reads its predecessor's gloo
    addresses and connects to a dead port (`Connection refused`). Also, the shared store's address is
    fixed at the job's first round, on the node that was rank 0 then, which may be the node that was
    lost. A fresh store per round has neither problem."""
    key = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    saved = os.environ.get(key)
    if enabled:
        os.environ[key] = "1"
    try:
        yield
    finally:
        if enabled:
            if saved is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = saved


@contextlib.contextmanager
def _quiet_torch_logs(*, enabled: bool) -> Iterator[None]:
    """Keep torch's elastic agent and its process spawner off the terminal: a failure reaches the user as
    `worker_failure`'s line, with the tracebacks in a log file."""
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS] if enabled else []
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def worker_failure(failures: dict[int, Any], log_dir: Path) -> str:
    """One line for a failed worker group: the rank torch saw fail first, its exception's message, and a
    log file holding every rank's traceback.

    `failures` is torch's `ChildFailedError.failures` ({global rank: ProcessFailure}); a rank that raised
    wrote `rank-R.json` ({"error", "traceback"}) into `log_dir` (`_worker`), including ranks torch
    stopped after the first failure. A rank that died without raising (a signal, `os._exit`) is named
    with its exit code."""
    first = min(failures, key=lambda r: (failures[r].timestamp, r))
    written = {int(path.stem.removeprefix("rank-")): json.loads(path.read_text())
               for path in log_dir.glob("rank-*.json")}
    sections = []
    for rank in sorted({*failures, *written}, key=lambda r: (r != first, r)):
        code = f"exit code {failures[rank].exitcode}" if rank in failures else "stopped after the first failure"
        body = written[rank]["traceback"] if rank in written else "no Python exception"
        sections.append(f"=== rank {rank} ({code}) ===\n{body.rstrip()}\n")
    log = log_dir / "workers.log"
    log.write_text("\n".join(sections))
    if first in written and written[first].get("stalled"):
        return f"{written[first]['error']}; the run was stopped, and the rank's stacks are in {log}"
    if first in written:
        return (f"a worker failed (rank {first}): {written[first]['error']}; the tracebacks of all ranks are in "
                f"{log} (rerun with --debug to see torch's logs)")
    return (f"a worker failed (rank {first}, exit code {failures[first].exitcode}) without a Python exception "
            f"(killed, or out of memory?); the other ranks' tracebacks are in {log}")


def _worker(plan_json: str, run: Any, log_dir: str | None = None,
            replan: Callable[[Plan, int], Plan] | None = None,
            environ: dict[str, str] | None = None) -> dict[str, Any] | None:
    """One rank: join the process group from torchrun's environment, train, report from rank 0. An
    exception other than a SoapError is written to `log_dir` (see `worker_failure`) and re-raised.
    `environ`: the launching process's environment when the rank was forked (`start_method`)."""
    if environ is not None:
        adopt_environment(environ)
    try:
        return _train_rank(plan_json, run, log_dir, replan)
    except Exception as exc:
        if log_dir is not None:
            message = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            record = {"error": message.rstrip(": "), "traceback": traceback.format_exc()}
            Path(log_dir, f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))
        time.sleep(RAISED_EXIT_DELAY_S)
        raise


def _train_rank(plan_json: str, run: Any, log_dir: str | None = None,
                replan: Callable[[Plan, int], Plan] | None = None) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from executor.train import train
    from executor.watchdog import Watchdog, limits_for

    plan = plan_from_dict(json.loads(plan_json))
    limits = limits_for(plan, run.timeout_s)
    backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
    store, rank, world_size = next(dist.rendezvous("env://"))
    replanned_from = None
    if replan is not None and world_size != plan.world_size:
        # every rank searches the same request deterministically, so all hold the same new plan
        replanned_from, plan = plan, replan(plan, world_size)
        limits = limits_for(plan, run.timeout_s)
    watchdog = Watchdog(limits, rank=rank, on_stall=lambda message: end_stalled_rank(message, log_dir)).start()
    watchdog.activity("on joining the process group", warmup=True)
    dist.init_process_group(backend, store=attempt_store(store), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=limits.process_group_s))
    try:
        result = train(plan, run, local_rank=int(os.environ.get("LOCAL_RANK", "0")), watchdog=watchdog,
                       replanned_from=replanned_from)
        return result.to_json() if dist.get_rank() == 0 else None
    except SoapError as exc:
        return {"error": str(exc)}
    finally:
        watchdog.activity("on destroying the process group")
        dist.destroy_process_group()
        watchdog.stop()


RAISED_EXIT_DELAY_S = 1.0
"""How long a rank that raised waits before it exits. The agent names the first rank it sees exit; when a
peer was killed (out of memory, a lost node), this rank's exception is what the peer's death caused (gloo's
"Connection closed by peer"), and a rank forked from the forkserver ends fast enough to be seen first."""

SERVER_ENVIRON = dict(os.environ)
"""The environment this module was imported under: in a rank forked from the forkserver (`start_method`),
the server's, as it was when the launching process first started it."""

FORKSERVER_PRELOAD = ["executor.launch", "executor.train"]
"""What the forkserver imports once for every rank it forks (torch, transformers, the executor), with the
plan's model code: about 5 s of one core per rank otherwise."""


def start_method(plan: Plan) -> str:
    """How the elastic agent starts the ranks. On a CUDA host `spawn`, as torchrun does (a rank must not
    inherit a CUDA context). On a CPU host `forkserver`: a server process imports the executor and the
    plan's HF model code once (`FORKSERVER_PRELOAD`) and forks every rank of this and later launches from
    it, where `spawn` would import them again in each rank (5 s of CPU each; 4 ranks on a 2-core host
    wait 10 s before they start). A later launch of another model imports its model code in each rank."""
    import multiprocessing

    import torch

    if torch.cuda.is_available():
        return "spawn"
    model_type = str(plan.model.config.get("model_type", "")).replace("-", "_")
    model_code = [f"transformers.models.{model_type}.modeling_{model_type}"] if model_type.isidentifier() else []
    # takes effect when the server first starts (a server started earlier, by this process, is kept); the
    # server skips a module it cannot import
    multiprocessing.get_context("forkserver").set_forkserver_preload([*FORKSERVER_PRELOAD, *model_code])
    return "forkserver"


def adopt_environment(environ: dict[str, str]) -> None:
    """Give a forked rank the environment a spawned one gets: the launching process's `environ` now, with
    what the elastic agent set for this rank (RANK, LOCAL_RANK, MASTER_PORT, TORCHELASTIC_*, ...) on top.
    The forkserver's own environment is the launching process's at the time it started, so a variable
    set or removed since (a test's, a notebook's) would otherwise be missed; the agent's are the ones
    that differ from the server's. OpenMP read OMP_NUM_THREADS when the server imported torch, so the
    rank's own thread count is set again."""
    import torch

    agent = {key: value for key, value in os.environ.items() if SERVER_ENVIRON.get(key) != value}
    os.environ.clear()
    os.environ.update({**environ, **agent})
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


STALLED_EXIT_CODE = 124
"""A worker's exit code when its watchdog ended it (timeout(1)'s)."""


def end_stalled_rank(message: str, log_dir: str | None) -> None:
    """The watchdog's `on_stall`: record `message` and every thread's stack (as `rank-R.json`, marked
    `stalled`, for `worker_failure`; on stderr as an `error:` line under an external torchrun), then end
    this process: its main thread is blocked in a wait that nothing else would end before the process
    group's timeout, and the elastic agent stops the other ranks once one has exited."""
    frames = sys._current_frames()
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    stacks = "".join(f"Thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}\n"
                     for ident, frame in frames.items())
    try:
        if log_dir is not None:
            record = {"error": message, "traceback": f"{message}\n\n{stacks}", "stalled": True}
            Path(log_dir, f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))
        else:
            print(f"error: {message}", file=sys.stderr, flush=True)
    finally:
        os._exit(STALLED_EXIT_CODE)


def attempt_store(store: Any) -> Any:
    """`store` with a key prefix naming this attempt of the worker group, when the store is the agent's.

    The agent's store (`TORCHELASTIC_USE_AGENT_STORE=True`: the static rendezvous, or an outside torchrun)
    lives as long as the job, and torch's env:// rendezvous joins it without a prefix, so a restarted
    group would read the keys its killed predecessor left there: gloo's peer addresses
    (`default_pg/0//cpu//0/RANK`: a rank connects to the dead rank's port and fails with `Connection
    refused`, unless the new peer happened to overwrite the key first) and the init barrier's counters.
    Each attempt (`TORCHELASTIC_RESTART_COUNT`) gets its own key space. A store of the group's own
    (`fresh_store_per_round`) is used as it is: the restart count may differ between its nodes."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return store
    return dist.PrefixStore(f"soap/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
