"""``rollout-bus prompts load FILE``: a user's prompts onto rollout.prompts; thin: parse, check, send.

The file (JSON lines or Parquet) is read and every line checked first (``rollout_bus.producers.prompt_file``):
a bad line, a bad flag or a tokenizer directory that is not one is one line naming it (``prompts.jsonl:7: ...``)
and exit 2, before the cluster is asked anything. Then a cluster that does not answer is one line within seconds
(exit 1); else the new prompt groups are sent (``rollout_bus.producers.prompt_loader``) with a progress bar on
stderr, and one summary line is printed: ``loaded N prompt groups (group_index A..B), skipped M already in the
run``. Loading the same file into the same run (``--topic-prefix``) again adds nothing. Exit 0 once every record
and the ledger's ``loaded`` event are acknowledged. Also ``python -m rollout_bus.cli.prompts load FILE``.
"""

from __future__ import annotations

from pathlib import Path

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from rollout_bus.cli import options
from rollout_bus.config import PromptLoadSettings
from rollout_bus.errors import ConfigError, RolloutBusError

app = typer.Typer(help="Load a user's prompts onto the run's rollout.prompts.", no_args_is_help=True)
console = Console(stderr=True)

FILE = typer.Argument(..., metavar="FILE", help="Prompts: JSON lines (.jsonl, .json) or Parquet (.parquet), one prompt group each.",
                      show_default=False)
PROMPT_KEY = typer.Option(None, "--prompt-key", help="The field holding the prompt: text, or a list of chat "
                          "messages [{role, content}] (default 'prompt'). A line may give 'input_ids' instead.")
LABEL_KEY = typer.Option(None, "--label-key", help="The field holding the label a reward needs (default 'label').")
TOKENIZER = typer.Option(None, "--tokenizer", metavar="DIR", help="A local Hugging Face tokenizer directory: turns "
                         "text into token ids, and chat messages through its chat template (never downloaded).")
N_SAMPLES = typer.Option(None, "--n-samples", help="Episodes per prompt group, for lines without 'n_samples' "
                         "(default 4).")
ADAPTER = typer.Option(None, "--adapter", help="The LoRA adapter for lines without 'adapter' (default none).")


def _settings(**flags: object) -> PromptLoadSettings:
    """The load's settings from the flags a user set; a value out of range is one line, exit 2."""
    try:
        return PromptLoadSettings(**options.given(**flags))
    except ValidationError as exc:
        options.refuse("; ".join(f"--{'-'.join(map(str, e['loc'])).replace('_', '-')}: {e['msg']}"
                                 for e in exc.errors()))


class _ProgressBar:
    """``progress(done, total)`` for the loader: a rich bar on stderr from the first send (none when nothing is
    sent); ``stop()`` leaves it drawn."""

    def __init__(self) -> None:
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._progress is None:
            self._progress = Progress(TextColumn("prompts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                      console=console, transient=False)
            self._progress.start()
            self._task = self._progress.add_task("prompts", total=total)
        self._progress.update(self._task, completed=done)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()


@app.command("load")
def load(
    file: Path = FILE,
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
    prompt_key: str | None = PROMPT_KEY,
    label_key: str | None = LABEL_KEY,
    tokenizer: Path | None = TOKENIZER,
    n_samples: int | None = N_SAMPLES,
    adapter: str | None = ADAPTER,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level."),
) -> None:
    """Check every line of FILE, then send the prompt groups the run does not have yet to rollout.prompts."""
    from rollout_bus.producers.prompt_file import PromptFileOptions, read_prompt_file
    from rollout_bus.producers.prompt_loader import load_prompts

    options.configure_logging(verbose)
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix)
    settings = _settings(prompt_key=prompt_key, label_key=label_key, tokenizer=tokenizer, n_samples=n_samples,
                         adapter=adapter)
    file_options = PromptFileOptions(prompt_key=settings.prompt_key, label_key=settings.label_key,
                                     tokenizer_dir=settings.tokenizer, n_samples=settings.n_samples,
                                     adapter=settings.adapter)
    try:
        lines = read_prompt_file(file, file_options)
    except ConfigError as exc:
        options.refuse(str(exc))
    kwargs, topics = kafka.client_kwargs(), kafka.topics()
    options.cluster_answers(kwargs)  # a closed port is said at once, in one line
    console.print(f"{len(lines)} prompt groups in {file.name} -> {topics.prompts} at {kwargs['bootstrap_servers']}")
    bar = _ProgressBar()
    try:
        summary = load_prompts(kwargs, topics, lines, progress=bar, max_record_bytes=kafka.max_record_bytes)
    except ConfigError as exc:
        options.say_error(exc, "prompts refused")
        raise typer.Exit(2) from exc
    except RolloutBusError as exc:
        options.say_error(exc)
        raise typer.Exit(1) from exc
    finally:
        bar.stop()
    typer.echo(summary.describe())


if __name__ == "__main__":  # python -m rollout_bus.cli.prompts load FILE
    app()
