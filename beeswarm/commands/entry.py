"""This machine as a swarm's entry (demo, chat, serve): the model's ends, sampling, speculation, the client."""
from __future__ import annotations

from beeswarm.commands.common import UserError


def speculation(args, entry):
    """(draft model or None, tuner) from --no-spec / --draft / --spec-depth / --spec-width / --spec-in-flight."""
    from beeswarm.shard.errors import ShardError
    from beeswarm.spec.draft import DraftModel, draft_ref
    from beeswarm.spec.tuner import MAX_DEPTH, MAX_IN_FLIGHT, MAX_WIDTH, Tuner

    def pinned(value: str, flag: str, most: int) -> int | None:
        if value == "auto":
            return None
        if not value.isdigit() or not 1 <= int(value) <= most:
            raise UserError(f"{flag} must be auto or 1..{most}, got {value!r}")
        return int(value)

    tuner = Tuner(depth=pinned(args.spec_depth, "--spec-depth", MAX_DEPTH),
                  width=pinned(args.spec_width, "--spec-width", MAX_WIDTH),
                  in_flight=pinned(args.spec_in_flight, "--spec-in-flight", MAX_IN_FLIGHT))
    ref = None if args.no_spec else draft_ref(args.model, args.draft)
    if ref is None:
        return None, tuner
    try:
        return DraftModel(ref, entry.config.vocab_size, "float32", "cpu"), tuner
    except ShardError as e:
        raise UserError(f"draft: {e}") from None


def sampling(args, entry):
    """The flags, or where a flag is not given the model's generation config (e.g. tinycode's tuned values)."""
    from beeswarm.generation.sampling import ModelDefaults

    try:
        return ModelDefaults.read(entry.folder).sampling(0.0 if args.greedy else args.temperature, args.top_p,
                                                         args.repetition_penalty, args.seed, fallback=(0.8, 0.95))
    except ValueError as e:
        raise UserError(str(e)) from None


def chat_common(args):
    """(sampling parameters, entry model) for a command that generates text."""
    from beeswarm.shard import EntryModel

    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    entry = EntryModel.load(args.model, args.dtype, args.device)
    return sampling(args, entry), entry


def encode_prompt(entry, args):
    """The tokenizer and the prompt's ids, checked against the model's context."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(entry.folder))
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise UserError("the prompt is empty")
    if len(ids) + args.max_new_tokens > entry.config.max_position_embeddings:
        raise UserError(f"prompt ({len(ids)} tokens) + --max-new-tokens exceeds the model's "
                        f"{entry.config.max_position_embeddings}-token context")
    return tokenizer, ids


def start_client(args, entry, bootstrap: list[str], draft, tuner, *, secret: bytes | None = None,
                 listen: list[str] | None = None, **options):
    """The started SwarmClient of demo, chat and serve: --heartbeat, --listen (else `listen`), --announce, --relay,
    --audit-rate, --audit-here and --identity from `args`; `options` are the command's other ClientOptions."""
    from beeswarm import secrets
    from beeswarm.client.swarm import ClientOptions, SwarmClient
    from beeswarm.p2p import identity

    try:
        payer = identity.load_or_create().key_pair if args.identity == "machine" else None
    except secrets.SecretError as e:
        raise UserError(f"--identity machine: {e}") from None
    return SwarmClient.create(entry, bootstrap, secret=secret, interval=args.heartbeat, listen=args.listen or listen,
                              announce=args.announce, relays=args.relay,
                              options=ClientOptions(audit_rate=args.audit_rate, audit_here=args.audit_here, **options),
                              draft=draft, tuner=tuner, payer=payer).start()


PLAN_WAIT_S = 60.0  # how long an entry waits for the swarm's plan to learn (or check) its model


def _plan(follower, node, timeout: float):
    """The first signed plan `follower` follows, within `timeout` (None: none came, or the swarm cannot be reached:
    `node.unreachable()` says why)."""
    import time

    deadline = time.monotonic() + timeout
    while not follower.state.coordinator:
        if node.unreachable() is not None or time.monotonic() > deadline:
            return None
        time.sleep(0.1)
    return follower.state


def swarm_model(args, bootstrap: list[str], secret: bytes | None) -> str:
    """The model the swarm serves, as its coordinator's plan names it (joined as an observer, then left): what an
    entry given no --model takes."""
    from pathlib import Path

    from beeswarm.client.status import SwarmObserver
    from beeswarm.shard import checkpoint

    observer = SwarmObserver.create(bootstrap, secret, args.heartbeat, listen=args.listen or None,
                                    relays=args.relay).start()
    try:
        plan = _plan(observer.coordinator, observer.node, PLAN_WAIT_S)
        unreachable = observer.node.unreachable()
    finally:
        observer.close()
    if unreachable is not None:
        raise UserError(f"cannot reach the swarm to learn its model: {unreachable}")
    if plan is None or not plan.model:
        raise UserError(f"the swarm named no model within {PLAN_WAIT_S:.0f} s (no coordinator yet, or an older "
                        "version): pass --model")
    hub_or_builtin = plan.model in checkpoint.BUILTIN or not Path(plan.model).expanduser().is_absolute()
    if not hub_or_builtin and not Path(plan.model).expanduser().is_dir():
        raise UserError(f"the swarm serves the model in {plan.model} on its coordinator's machine, not here: pass "
                        "--model with your copy of it")
    return plan.model


def check_model(client, entry, model: str) -> None:
    """Refuse to serve a swarm of another model than `model`: the swarm's plan names its model's fingerprint, and
    an entry holding another would get only errors from every route (or, worse, another model's text). A swarm
    that cannot be reached, or names no plan in time, is not refused here: its routes will say what is wrong."""
    from beeswarm.shard import checkpoint

    plan = _plan(client.coordinator, client.node, PLAN_WAIT_S)
    mine = checkpoint.fingerprint(entry.folder)
    if plan is not None and plan.fingerprint and plan.fingerprint != mine:
        raise UserError(f"this swarm serves {plan.model} (config fingerprint {plan.fingerprint}); --model {model} is "
                        f"another model ({mine}): pass --model {plan.model}, or leave --model out to take the "
                        "swarm's")
