"""``rollout-bus demo``: the main job, end to end, on the local broker unless one is given.

Two ways to make the episodes: the seeded generator (the default, as the harnesses use it), or with
``--from-prompts`` (``make demo``'s and ``make learn``'s way) a prompt file (``--prompts FILE``, default the
packaged ``rollout_bus/demo/prompts.jsonl``; with ``--learn`` the calculator task's problems) loaded and made by
``--generators N`` members of the generators' group (``demo.prompts_run``). The file and the flags that only the seeded generator takes are refused in one line
(exit 2) before a broker is touched.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from rollout_bus.cli import options
from rollout_bus.config import BatchingSettings, KafkaSettings
from rollout_bus.errors import BrokerError, ConfigError, ContractError
from rollout_bus.local_kafka.local_broker import BrokerLease
from rollout_bus.demo.run_dir import out_problem
from rollout_bus.wire.topics import check_prefix

if TYPE_CHECKING:
    from rollout_bus.demo.run import DemoOptions

console = Console(stderr=True)

# demo --learn: 8 prompt groups of 8 per batch, 80 batches
LEARN_GROUPS_PER_BATCH, LEARN_SAMPLES_PER_PROMPT = 8, 8
LEARN_EPISODES = 80 * LEARN_GROUPS_PER_BATCH * LEARN_SAMPLES_PER_PROMPT
DEMO_PROMPTS, DEMO_GENERATORS = "prompts.jsonl", 2  # --from-prompts: the packaged file, the members sharing it


def packaged_prompts() -> Path:
    """The demo's own prompt file, installed with the package (pyproject.toml's package-data)."""
    return Path(str(resources.files("rollout_bus.demo").joinpath(DEMO_PROMPTS)))


def demo(
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = typer.Option(None, "--topic-prefix", envvar="ROLLOUT_BUS_TOPIC_PREFIX",
                                            help="Topic prefix (default: demo-<run id>., fresh topics per run)."),
    episodes: int | None = typer.Option(None, "--episodes", min=1,
                                        help="Episodes to generate (episodes / n prompt groups; default 64, with "
                                             f"--learn {LEARN_EPISODES})."),
    seed: int = typer.Option(0, "--seed", help="Seeds the generator: the same seed gives byte-identical shards."),
    adapters: str = typer.Option("", "--adapters", help="Comma-separated LoRA adapters, e.g. math,code."),
    n_samples_per_prompt: int | None = typer.Option(None, "--n-samples-per-prompt", min=1,
                                                    help="Episodes per prompt group (default 4, with --learn 8)."),
    groups_per_batch: int | None = options.GROUPS_PER_BATCH,
    batching: str | None = options.BATCHING,
    dp_size: int = options.DP_SIZE,
    out: Path | None = typer.Option(None, "--out", help="Where shards and logs go (default: demo-out/<run id>)."),
    inject_faults: bool = typer.Option(False, "--inject-faults", help="Also send bad records, to show the DLQ."),
    timeout: float = typer.Option(300.0, "--timeout", help="Give up after this many seconds."),
    train: bool = typer.Option(False, "--train", help="Also run train-sim on the shards (every rank) and check that "
                                                      "every written batch is trained exactly once per rank."),
    max_staleness: int | None = options.MAX_STALENESS,
    interrupt_prob: float = typer.Option(0.0, "--interrupt-prob", min=0.0, max=1.0,
                                         help="With --max-staleness: share of turns cut (an aborted part and its "
                                              "continuation) when new weights go live while they are generated."),
    learn: bool = typer.Option(False, "--learn", help="The real loop: the generator samples from the real policy, "
                                                      "`rollout-bus train` trains it and ships every version back "
                                                      "(implies --train; default --max-staleness 1, 8 groups of 8 "
                                                      "per batch); exit 0 only if the reward rises."),
    port: int = options.PORT,
    secure: bool = typer.Option(False, "--secure", help="On a secured local broker (TLS, SCRAM, ACLs: `rollout-bus "
                                                        "kafka start --secure`, its data in broker-PORT-secure), each "
                                                        "stage as its role's principal with the run's ACLs only."),
    from_prompts: bool = typer.Option(False, "--from-prompts", help="Make the episodes from a prompt file (--prompts) "
                                      "with a group of `generate --from-prompts` members instead of the seeded "
                                      "generator; the run closes itself once every prompt group is done or failed."),
    prompts: Path | None = typer.Option(None, "--prompts", metavar="FILE", help="The prompt file to load (JSON lines "
                                        "or Parquet, as `rollout-bus prompts load`; implies --from-prompts; default "
                                        "with --from-prompts: the packaged 16 prompt groups of 4)."),
    generators: int | None = typer.Option(None, "--generators", min=1, help="--from-prompts: members of the "
                                          f"generators' group sharing the prompts (default {DEMO_GENERATORS})."),
    kill_members: int = typer.Option(0, "--kill-members", min=0, metavar="N", help="--from-prompts, a drill: kill "
                                     "-9 a member holding a prompt group part-way N times mid-run, a new member "
                                     "started in its place each time (the takers resume from the log)."),
) -> None:
    """Run generator, stream worker and shard writer as separate processes; show progress, metrics, shards.

    --max-staleness needs --train (it closes the loop: without a trainer no weight version is published).
    Exit 0 only when every valid episode the generator finished is in exactly one shard (with
    --inject-faults, the deliberately bad records and the batch their replay gap fails go to the DLQ).
    With --train, train-sim (a fourth process) trains on the shards; then also only when it trained
    every written batch exactly once per rank, in seq order. With --from-prompts (`make demo`) the prompt
    file is loaded and --generators members make its episodes, closing the run themselves; the report adds
    the prompt ledger (loaded, done, redelivered, failed).
    """
    settings = KafkaSettings(bootstrap_servers=bootstrap_servers or "", local_port=port)
    train, max_staleness, groups_per_batch = _learn_defaults(learn, train, max_staleness, groups_per_batch)
    run_batching = options.role_settings(BatchingSettings, groups_per_batch=groups_per_batch, batching=batching,
                                         max_staleness=max_staleness)
    from_prompts = from_prompts or prompts is not None
    prompts_file = _prompts_file(from_prompts, prompts, generators, learn=learn, run_batching=run_batching,
                                 kill_members=kill_members, adapters=adapters, inject_faults=inject_faults,
                                 interrupt_prob=interrupt_prob,
                                 **({} if learn else {"episodes": episodes,
                                                      "n_samples_per_prompt": n_samples_per_prompt}))
    _refuse_unrunnable(run_batching, train=train, secure=secure, settings=settings)
    _refuse_mistakes(topic_prefix, out)
    if settings.bootstrap_servers:  # a closed port is said before the harness's imports (torch: seconds)
        options.cluster_answers(settings.client_kwargs())
    from rollout_bus.demo.run import DemoOptions  # the harness imports torch (seconds): only when a demo runs

    run_options = DemoOptions(episodes=episodes or (LEARN_EPISODES if learn else 64), seed=seed, adapters=adapters,
                              n_samples_per_prompt=n_samples_per_prompt or (LEARN_SAMPLES_PER_PROMPT if learn else 4),
                              batching=run_batching, dp_size=dp_size, out=out, topic_prefix=topic_prefix,
                              inject_faults=inject_faults, timeout_s=timeout,
                              max_record_bytes=settings.max_record_bytes, train=train,
                              interrupt_prob=interrupt_prob, learn=learn, from_prompts=from_prompts,
                              prompts=prompts_file, generators=generators or DEMO_GENERATORS,
                              kill_members=kill_members)
    raise typer.Exit(_run_on_broker(settings, run_options, port=port, secure=secure))


def _learn_defaults(learn: bool, train: bool, max_staleness: int | None,
                    groups_per_batch: int | None) -> tuple[bool, int | None, int | None]:
    """With --learn the loop must be closed for the policy to see its own updates: train, a staleness bound
    (1 unless given), and the learn batch size unless given."""
    if not learn:
        return train, max_staleness, groups_per_batch
    return True, 1 if max_staleness is None else max_staleness, groups_per_batch or LEARN_GROUPS_PER_BATCH


def _refuse_unrunnable(run_batching: BatchingSettings, *, train: bool, secure: bool, settings: KafkaSettings) -> None:
    """Exit 2 on flags that cannot run together, before anything starts."""
    if run_batching.max_staleness is not None and not train:
        console.print("[red]error:[/red] --max-staleness needs --train: without a trainer no weight version is "
                      "published, and the generator would wait for ever")
        raise typer.Exit(2)
    if secure and settings.bootstrap_servers:
        console.print("[red]error:[/red] --secure runs on the secured local broker it starts; for a cluster of your "
                      "own, give its security settings (ROLLOUT_BUS_SECURITY_PROTOCOL, ...) without --secure")
        raise typer.Exit(2)


def _refuse_mistakes(topic_prefix: str | None, out: Path | None) -> None:
    """Exit 2 in one line, before a broker, a topic or a file is touched, on a prefix Kafka would refuse or an
    --out that is a file, read-only, or holds another run."""
    if topic_prefix is not None:
        try:
            check_prefix(topic_prefix)
        except ContractError as exc:
            options.refuse(f"--topic-prefix: {exc}")
    problem = None if out is None else out_problem(out)
    if problem is not None:
        options.refuse(problem)


def _prompts_file(from_prompts: bool, prompts: Path | None, generators: int | None, *, learn: bool,
                  run_batching: BatchingSettings, kill_members: int = 0, **seeded_only: object) -> Path | None:
    """With --from-prompts: the prompt file, read and checked (exit 2 in one line naming a bad line, or the flags
    only the seeded generator takes), or with --learn and no --prompts None (the run writes the calculator task's
    problems: --episodes and --n-samples-per-prompt size them); without: None (exit 2 on --generators)."""
    if not from_prompts:
        if generators is not None:
            options.refuse("--generators is for --from-prompts (the seeded demo runs one generator)")
        if kill_members:
            options.refuse("--kill-members is for --from-prompts (it kills members of the generators' group)")
        return None
    given = [f"--{name.replace('_', '-')}" for name, value in seeded_only.items()
             if value not in (None, "", False, 0.0)]
    given += ["--max-staleness"] if run_batching.max_staleness is not None and not learn else []
    if given:
        options.refuse(f"{', '.join(given)}: only the seeded generator takes {'it' if len(given) == 1 else 'them'}; "
                       "with --from-prompts the prompt file says what to generate (leave --from-prompts and "
                       "--prompts out for the seeded demo)")
    from rollout_bus.producers.prompt_file import read_prompt_file

    if learn and prompts is None:
        return None
    path = prompts if prompts is not None else packaged_prompts()
    try:
        read_prompt_file(path)
    except ConfigError as exc:
        options.refuse(f"--prompts: {exc}")
    return path


def _run_on_broker(settings: KafkaSettings, run_options: DemoOptions, *, port: int, secure: bool) -> int:
    """Run the demo on the given cluster, or on a local broker leased for it; exit 1 when there is none."""
    try:
        lease = BrokerLease(settings.bootstrap_servers or None, port=port, secure=secure,
                            echo=lambda m: console.print(f"[dim]{m}[/dim]"))
        with lease as bootstrap:
            if secure:  # the demo itself is the admin; its stages are the roles
                conn, run_options.principals = lease.broker.connection(), lease.broker.secure.directory
            else:
                conn = {**settings.client_kwargs(), "bootstrap_servers": bootstrap}
            options.cluster_answers(conn)  # a closed port is said at once, in one line
            from rollout_bus.demo.run import run_demo

            return run_demo(conn, run_options, console)
    except (BrokerError, ConfigError) as exc:
        options.say_error(exc)
        raise typer.Exit(1) from exc
