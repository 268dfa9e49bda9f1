"""What a bus client holds, for failure messages: when a request goes missing, say
whether nats-server delivered it to a subscription's client and whether the
subscription's callback task took it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inferbus_testing.servers import NatsServer


def subscription_state(sub: Any) -> str:
    """A nats-py subscription's counters: messages delivered to it, still queued for
    its callback, and whether the task that runs the callback is alive."""
    if sub is None:
        return "none"
    task = sub._wait_for_msgs_task  # nats-py keeps it private
    alive = "running" if task is not None and not task.done() else "stopped"
    return f"received {sub.delivered}, queued {sub.pending_msgs}, callback task {alive}"


def router_subscriptions(router: Any) -> str:
    """`subscription_state` of an `inferbus_router.router.Router`'s request
    subscriptions (bundles, generation, "no responders" of generation)."""
    names = ("_sub", "_gen_sub", "_nr_gen_sub")
    subs = "; ".join(f"{n.strip('_')}: {subscription_state(getattr(router, n))}" for n in names)
    return f"{subs}; {client_state(router._nc)}"


def client_state(nc: Any) -> str:
    """A nats-py client's own count of messages in, and per subscription (subject,
    queue group) how many it was handed: beside nats-server's ``/connz`` counts
    for the same connection, this says whether a message the server counted as
    sent reached the client and which subscription took it."""
    subs = ", ".join(
        f"{s.subject}{' q=' + s.queue if s.queue else ''}:{s.delivered}"
        for s in list(nc._subs.values())  # nats-py keeps them private
    )
    return f"client in {nc.stats['in_msgs']} msgs; subs [{subs}]"


def lost_request_report(server: NatsServer, subject: str, router: Any) -> str:
    """For a test whose request published on `subject` through `router` got no
    answer: the router's subscriptions and client counters, what nats-server's
    subscription list matches for `subject` now, and every connection with its
    subscriptions and message counts."""
    return (
        f"router {router_subscriptions(router)}; {server.subscribers(subject)}; "
        f"connections:\n{server.connections()}"
    )
