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
