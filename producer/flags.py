"""The command-line flags genq's commands share (`genq submit`, `status`, `bench`, `worker`,
`gateway`, `celery-bridge`): the Redis URL and key prefix, checked when parsed, and the payload
caps. Imports nothing of genq but the protocol and its caps, so the worker may use it too."""

from __future__ import annotations

import argparse
import os

from producer.limits import Limits
from producer.protocol import DEFAULT_PREFIX, ProtocolError, validate_name


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every command's --help gives each option's default (or says it is required), unless its
    help text already says it; switches (store_true) have none to give."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or "default" in text
                or action.default is argparse.SUPPRESS):
            return text
        if action.required:
            return f"{text} (required)".strip()
        return f"{text} (default: {'none' if action.default is None else '%(default)s'})".strip()


def redis_url(value: str) -> str:
    """argparse type: a URL genq can connect to (producer.connection: redis://, rediss://,
    unix://, redis+sentinel://, redis+cluster://): a usage error now, not a traceback later."""
    from producer.connection import parse

    try:
        parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None  # (no echo: it may hold a password)
    return value


def key_prefix(value: str) -> str:
    """argparse type: a valid key prefix."""
    try:
        validate_name(value, "key prefix")
    except ProtocolError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return value


def add_redis_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                   what: str = "Redis") -> None:
    parser.add_argument("--redis", type=redis_url,
                        default=os.environ.get("GENQ_REDIS", "redis://127.0.0.1:6379/0"),
                        help=f"{what} URL (env GENQ_REDIS; default: redis://127.0.0.1:6379/0)")
    parser.add_argument("--prefix", type=key_prefix,
                        default=os.environ.get("GENQ_PREFIX", DEFAULT_PREFIX),
                        help="key prefix shared by the fleet's producers and workers (env "
                             "GENQ_PREFIX; default: %(default)s)")


def add_limit_args(parser: argparse.ArgumentParser, who: str) -> None:
    """The payload caps (limits.Limits) as flags; the gateway checks the same ones as the
    workers, so give both the same values."""
    c = parser.add_argument_group("payload caps", f"what {who} refuses (limit_exceeded)")
    c.add_argument("--max-job-bytes", type=int, default=Limits.max_job_bytes,
                   help="a larger job payload is refused (default: %(default)s)")
    c.add_argument("--max-prompt-bytes", type=int, default=Limits.max_prompt_bytes,
                   help="a larger prompt is refused (default: %(default)s)")
    c.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="a prompt of more tokens is refused (default: the model's max length)")
    c.add_argument("--max-tokens-cap", type=int, default=Limits.max_tokens,
                   help="the largest max_tokens a job may ask for (a worker gives a job "
                        "with max_tokens null this many; default: %(default)s)")
    c.add_argument("--max-n", type=int, default=Limits.max_n,
                   help="the largest n / best_of a job may ask for (default: %(default)s)")
    c.add_argument("--max-stop", type=int, default=Limits.max_stop,
                   help="the most stop strings a job may give (default: %(default)s)")
    c.add_argument("--max-grammar-bytes", type=int, default=Limits.max_grammar_bytes,
                   help="a larger structured_outputs (a JSON schema, regex, choice or grammar, "
                        "as compact JSON) is refused (default: %(default)s)")


def limits_from_args(args: argparse.Namespace) -> Limits:
    return Limits(max_job_bytes=args.max_job_bytes, max_prompt_bytes=args.max_prompt_bytes,
                  max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens_cap,
                  max_n=args.max_n, max_stop=args.max_stop,
                  max_grammar_bytes=args.max_grammar_bytes)
