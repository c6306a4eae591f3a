"""``rollout-bus acl apply|list``: least privilege on a secured cluster, one role's ACLs on one run's prefix.

``apply --role R --principal P`` creates the ACLs of role R (``rollout_bus.kafka.acls.role_bindings``) for the
SCRAM user P on the topics and groups of ``--topic-prefix``, so a run's principals reach only that run's
topics; ``--dry-run`` prints them without a broker. ``--role all`` (no ``--principal``) grants every role to the
principal of its name, as the local secured broker and the compose stack name them. It runs as a principal that may set ACLs (the secured
local broker's ``admin``: ``set -a; . DATA_DIR/secure/admin.env; set +a``). Creating the user itself is
Kafka's job (``kafka-configs --alter --entity-type users --add-config-file``). ``list`` prints every ACL the
cluster holds, as the broker reports it. Also ``python -m rollout_bus.cli.acl``.
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rollout_bus.cli import options
from rollout_bus.errors import BrokerError, ConfigError
from rollout_bus.kafka.acls import ROLES, apply_bindings, list_bindings, role_bindings

app = typer.Typer(help="Create or list the Kafka ACLs of each role (a cluster with an authorizer).",
                  no_args_is_help=True)
console = Console(stderr=True)


@app.command()
def apply(
    role: str = typer.Option(..., "--role", help=f"One of: {', '.join(ROLES)}; or all (each to the principal of its name)."),
    principal: str | None = typer.Option(None, "--principal",
                                         help="The SCRAM user (without 'User:') that plays the role."),
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the ACLs, create nothing (no broker needed)."),
) -> None:
    """Create the ACLs ROLE needs on the run of --topic-prefix, for PRINCIPAL; print each one."""
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix)
    try:
        grants = _grants(role, principal)
        bindings = [(user, b) for each, user in grants for b in role_bindings(each, user, kafka.topics())]
        if not dry_run:
            apply_bindings(kafka.client_kwargs(), bindings)
    except (BrokerError, ConfigError) as exc:
        options.say_error(exc)
        raise typer.Exit(1) from exc
    for user, binding in bindings:
        print(f"User:{user} ALLOW {binding}")
    done = "would be created (dry run)" if dry_run else "in place"
    whom = ", ".join(f"{each} for User:{user}" for each, user in grants)
    console.print(f"{len(bindings)} ACLs of role {whom} on prefix {kafka.topic_prefix or '(none)'!r} {done}")


def _grants(role: str, principal: str | None) -> list[tuple[str, str]]:
    """``(role, principal)`` pairs: one named pair, or every role to the principal of its name."""
    if role == "all":
        if principal:
            raise ConfigError(f"--principal {principal!r} with --role all: all grants each role to the principal "
                              "of its name; name one role to grant it to another principal")
        return [(each, each) for each in ROLES]
    if not principal:
        raise ConfigError(f"--role {role} needs --principal, the SCRAM user that plays it")
    return [(role, principal)]


@app.command("list")
def list_acls(bootstrap_servers: str | None = options.BOOTSTRAP) -> None:
    """Print every ACL the cluster holds: principal, resource, pattern, name, operation."""
    kafka = options.kafka_settings(bootstrap_servers, None)
    try:
        found = list_bindings(kafka.client_kwargs())
    except BrokerError as exc:
        options.say_error(exc)
        raise typer.Exit(1) from exc
    table = Table("principal", "resource", "pattern", "name", "operation", title=f"ACLs ({len(found)})")
    for principal, b in found:
        table.add_row(escape(f"User:{principal}"), b.resource, b.pattern, escape(b.name), b.operation)
    Console(width=160).print(table)


if __name__ == "__main__":  # python -m rollout_bus.cli.acl
    app()
