"""Flags several commands share: the model, sampling and speculative decoding."""

from __future__ import annotations

import argparse
import os

from specserve.engine.loading import RemoteOptions
from specserve.engine.sampling import SamplingParams
from specserve.errors import SpecserveError
from specserve.kernels.kv_format import FORMATS as KV_FORMATS
from specserve.kernels.kv_format import KVTypes
from specserve.model.weights import WEIGHT_FORMATS
from specserve.remote.protocol import KEEPALIVE_INTERVAL, STEP_TIMEOUT, parse_address
from specserve.speculative.base import SELECTABLE_TYPES, SpecParams


def add_model_args(p: argparse.ArgumentParser) -> None:
    add_remote_args(p)
    p.add_argument("-m", "--model", default=os.environ.get("LLAMA_ARG_MODEL"),
                   help="catalog name or GGUF path (default: the embedded default model)")
    p.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="context size per sequence (default: min(model, 4096))")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: cuda when available)")
    p.add_argument("--weight-format", default="auto", choices=WEIGHT_FORMATS,
                   help="matrices in memory: auto = gguf on a CPU with AVX2 or AVX-512 and a C compiler, else float; "
                        "float = bf16 on CUDA, fp32 on CPU; gguf = the file's own quantization kept, 4/8-bit "
                        "(fewer bytes a token: faster decode, slower verify steps on CUDA); q8 = Q8_0-style 8-bit")
    p.add_argument("-ctk", "--cache-type-k", default=None, choices=list(KV_FORMATS), metavar="TYPE",
                   help=f"how keys are stored in the KV cache: {', '.join(KV_FORMATS)} (default: the compute dtype, "
                        "bf16 on CUDA, fp32 on CPU); q8_0 / q4_0 take about half / a quarter of f16's memory")
    p.add_argument("-ctv", "--cache-type-v", default=None, choices=list(KV_FORMATS), metavar="TYPE",
                   help="how values are stored in the KV cache (as -ctk)")
    add_batch_invariant_arg(p)
    p.add_argument("-tp", "--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N ranks (torch.distributed: gloo on CPU, NCCL on CUDA, one GPU a "
                        "rank); starts N-1 follower processes, or, under torchrun, joins its ranks (float weights)")


def add_batch_invariant_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-invariant", action="store_true",
                   default=os.environ.get("SPECSERVE_BATCH_INVARIANT") == "1",
                   help="CUDA: every row computed in the same bits whatever else its step holds, so greedy text "
                        "never depends on other requests (slower; the CPU path is so without it)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temp", type=float, default=0.8, help="temperature; <= 0 is greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--repeat-last-n", type=int, default=64)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("-s", "--seed", type=int, default=-1, help="RNG seed (-1 = random)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    d = SpecParams()
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--spec-type", default=d.type, help=f"[{'|'.join(SELECTABLE_TYPES)}] (default: none)")
    g.add_argument("--spec-ngram-size-n", type=int, default=d.ngram_size_n)
    g.add_argument("--spec-ngram-size-m", type=int, default=d.ngram_size_m)
    g.add_argument("--spec-ngram-check-rate", type=int, default=d.ngram_check_rate)
    g.add_argument("--spec-ngram-min-hits", type=int, default=d.ngram_min_hits)
    g.add_argument("--draft-max", "--draft", "--draft-n", dest="draft_max", type=int, default=d.n_max)
    g.add_argument("--draft-min", "--draft-n-min", dest="draft_min", type=int, default=d.n_min)
    g.add_argument("--draft-p-min", type=float, default=d.p_min)
    g.add_argument("--draft-tree", dest="draft_tree", type=int, default=d.tree_nodes, metavar="N",
                   help="verify up to N nodes of a token tree merged from every drafter's candidate in one step "
                        "(greedy requests; 0: the first drafter's chain, as llama.cpp)")
    g.add_argument("-md", "--model-draft", default=None, help="draft model: catalog name or GGUF path")
    g.add_argument("-ctkd", "--cache-type-k-draft", "--spec-draft-type-k", dest="cache_type_k_draft", default=None,
                   choices=list(KV_FORMATS), metavar="TYPE", help="the draft model's KV keys (default: as -ctk)")
    g.add_argument("-ctvd", "--cache-type-v-draft", "--spec-draft-type-v", dest="cache_type_v_draft", default=None,
                   choices=list(KV_FORMATS), metavar="TYPE", help="the draft model's KV values (default: as -ctv)")
    g.add_argument("-lcs", "--lookup-cache-static", default=None, help="static ngram-cache file (must exist)")
    g.add_argument("-lcd", "--lookup-cache-dynamic", default=None, help="dynamic ngram-cache file (read and updated)")


def spec_params_from_args(args: argparse.Namespace) -> SpecParams:
    return SpecParams(
        type=args.spec_type, n_max=args.draft_max, n_min=args.draft_min, p_min=args.draft_p_min,
        ngram_size_n=args.spec_ngram_size_n, ngram_size_m=args.spec_ngram_size_m,
        ngram_check_rate=args.spec_ngram_check_rate, ngram_min_hits=args.spec_ngram_min_hits,
        lookup_cache_static=args.lookup_cache_static, lookup_cache_dynamic=args.lookup_cache_dynamic,
        tree_nodes=args.draft_tree,
    ).validate()


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, seed=args.seed,
    ).validate()


def add_remote_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("remote host")
    g.add_argument("--remote", default=None, metavar="ADDR",
                   help="run the model on a `specserve remote-host` at unix:PATH or tcp:HOST:PORT (-m names it there)")
    g.add_argument("--remote-token", default=os.environ.get("SPECSERVE_REMOTE_TOKEN"),
                   help="the host's shared token [env: SPECSERVE_REMOTE_TOKEN]")
    g.add_argument("--remote-timeout", type=float, default=STEP_TIMEOUT,
                   help=f"seconds without a reply or a keep-alive (the host sends one every {KEEPALIVE_INTERVAL:g} s "
                        f"while it works) before the host counts as gone (default {STEP_TIMEOUT:g})")


def tensor_parallel_from_args(args: argparse.Namespace) -> int:
    """--tensor-parallel N, checked against the flags it cannot go with."""
    n: int = args.tensor_parallel
    if n < 1:
        raise SpecserveError(f"--tensor-parallel must be at least 1, got {n}")
    if n > 1 and getattr(args, "remote", None) is not None:
        raise SpecserveError("--tensor-parallel splits a model run here; it does not go with --remote")
    return n


def remote_from_args(args: argparse.Namespace) -> RemoteOptions | None:
    if getattr(args, "remote", None) is None:
        return None
    try:
        parse_address(args.remote)
    except ValueError as exc:
        raise SpecserveError(f"--remote: {exc}") from None
    if args.remote_timeout < 2 * KEEPALIVE_INTERVAL:  # else a working host's next keep-alive may come too late
        raise SpecserveError(f"--remote-timeout must be at least {2 * KEEPALIVE_INTERVAL:g} s")
    return RemoteOptions(args.remote, args.remote_token, args.remote_timeout)


def kv_types_from_args(args: argparse.Namespace, draft: bool = False) -> KVTypes:
    """-ctk/-ctv; draft: -ctkd/-ctvd, each falling back to the target's."""
    target = getattr(args, "cache_type_k", None), getattr(args, "cache_type_v", None)
    if not draft:
        return target
    k, v = getattr(args, "cache_type_k_draft", None), getattr(args, "cache_type_v_draft", None)
    return k or target[0], v or target[1]
