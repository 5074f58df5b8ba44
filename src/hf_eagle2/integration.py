"""Hooks `tree=` speculation into stock `transformers` `generate()`.

`register()` (run on `import hf_eagle2`, safe to call again) wraps `GenerationMixin.generate` once:

* `generate(..., assistant_model=<EagleDraftModel>, tree="eagle2" | "eagle1" | "chain", tree_total_tokens=...,
  tree_depth=..., tree_top_k=...)` runs the hf_eagle2 loop as a `custom_generate` callable, so transformers
  still prepares the generation config, logits processors, stopping criteria and cache. The `tree*` values may
  also live in a `GenerationConfig` (custom fields): `GenerationConfig(tree="eagle2", tree_total_tokens=60)`.
* `generate(..., assistant_model=<EagleDraftModel>)` without `tree` is the *stock* assisted-decoding loop, fed
  by the same head as a chain `CandidateGenerator` (`num_assistant_tokens` or `tree_depth` tokens per round, 6 if
  neither is set: transformers' default of 20 is meant for assistant models).
* Anything else goes to the original `generate` untouched, including a `custom_generate` repo or folder name:
  transformers loads that recipe, and the repo's own `custom_generate/generate.py` comes back in here through
  `hub_generate`.

`hub_generate` is that Hub entry: the same `_generate`, for interpreters whose own code never imported hf_eagle2.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from typing import Any

from transformers import GenerationMixin, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from .engine.candidate_generator import EagleCandidateGenerator, TreeOptions
from .engine.decoding import OTHER_DRAFTERS, eagle_generate
from .heads.modeling_eagle import EagleDraftModel

# generate kwarg / GenerationConfig field -> TreeOptions field
TREE_FIELDS = {
    "tree": "tree",
    "tree_total_tokens": "total_tokens",
    "tree_depth": "depth",
    "tree_top_k": "top_k",
    "tree_global_value": "use_global_value",
    "tree_rerank": "rerank",
    "tree_static_paths": "static_paths",
    "tree_ngram": "ngram",
    "eagle_record_calibration": "record_calibration",
    "eagle_profile": "profile",
    "tree_compile": "compile",
}
DEFAULT_CHAIN_DEPTH = 6
# the tree options each path reads (None: no tree=, an EAGLE head drafting a chain in the stock assisted loop);
# one passed to generate that the chosen path does not read is an error, not silently dropped
USED_BY = {
    "eagle2": set(TREE_FIELDS) - {"tree_static_paths"},
    "eagle1": {"tree", "tree_static_paths", "eagle_record_calibration", "eagle_profile"},
    "chain": {"tree", "tree_depth", "eagle_record_calibration", "eagle_profile"},
    None: {"tree_depth"},
}
# generate kwargs transformers used to fetch a custom_generate repo; they reach the recipe too, not the model
HUB_KWARGS = ("token", "revision", "cache_dir", "local_files_only", "force_download", "proxies", "repo_type")


def register() -> None:
    """Installs the hooks (idempotent)."""
    if getattr(GenerationMixin.generate, "_hf_eagle2_original", None) is None:
        original = GenerationMixin.generate

        @functools.wraps(original)
        def generate(self, *args, **kwargs):
            return _generate(original, self, *args, **kwargs)

        generate._hf_eagle2_original = original
        GenerationMixin.generate = generate
    if getattr(GenerationMixin._get_candidate_generator, "_hf_eagle2_original", None) is None:
        original_getter = GenerationMixin._get_candidate_generator

        @functools.wraps(original_getter)
        def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, assistant_model=None, **kwargs):  # noqa: E501
            if isinstance(assistant_model, EagleDraftModel):
                for option, is_set, why in OTHER_DRAFTERS:
                    if is_set(generation_config):
                        raise ValueError(f"an EAGLE head as assistant_model cannot be combined with {option}: {why}")
                depth = getattr(generation_config, "num_assistant_tokens", None) or DEFAULT_CHAIN_DEPTH
                options = TreeOptions(tree="chain", depth=int(depth))
                return EagleCandidateGenerator(assistant_model, self, options, max_length=generation_config.max_length)
            return original_getter(
                self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, assistant_model, **kwargs
            )

        _get_candidate_generator._hf_eagle2_original = original_getter
        GenerationMixin._get_candidate_generator = _get_candidate_generator


def unregister() -> None:
    """Restores the original methods."""
    for name in ("generate", "_get_candidate_generator"):
        original = getattr(getattr(GenerationMixin, name), "_hf_eagle2_original", None)
        if original is not None:
            setattr(GenerationMixin, name, original)


def hub_generate(model, *args, **kwargs):
    """The body of the repo's `custom_generate/generate.py`: transformers passes it the user's `generate` arguments,
    `model` in place of `self`, for `generate(..., custom_generate=<repo or folder>, trust_remote_code=True, ...)`.

    `assistant_model` may be a head folder or Hub id (`EagleDraftModel.from_pretrained`, with the call's `token`,
    `cache_dir`, `local_files_only`; `revision` pins the code repo, not the head). The rest is `_generate` over the
    unwrapped `GenerationMixin.generate`, as after `import hf_eagle2`; not `model.generate`, which may be this very
    recipe (`from_pretrained(..., trust_remote_code=True)` binds a repo's custom_generate to the instance).
    """
    hub = {key: kwargs.pop(key) for key in HUB_KWARGS if key in kwargs}
    assistant = kwargs.get("assistant_model")
    if isinstance(assistant, (str, os.PathLike)):
        load = {key: hub[key] for key in ("token", "cache_dir", "local_files_only") if key in hub}
        kwargs["assistant_model"] = EagleDraftModel.from_pretrained(assistant, **load)
    original = getattr(GenerationMixin.generate, "_hf_eagle2_original", GenerationMixin.generate)
    return _generate(original, model, *args, **kwargs)


def _resolve(key: str, kwargs: dict, generation_config, model_config) -> Any:
    if key in kwargs:
        return kwargs.pop(key)
    for config in (generation_config, model_config):
        value = getattr(config, key, None) if config is not None else None
        if value is not None:
            return value
    return None


def _generate(original, self, *args, **kwargs):
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self")
    extra = arguments.pop("kwargs", {})
    for name in ("cache", "past_key_values"):  # any generate call, plain ones too: never continue from holes
        if getattr(extra.get(name), "_hf_eagle2_holes", False):
            from .engine.decoding import HOLES_MESSAGE

            raise ValueError(HOLES_MESSAGE)
    if isinstance(arguments.get("custom_generate"), str):  # a Hub/folder recipe: transformers loads and runs it
        return original(self, **arguments, **extra)
    generation_config = arguments.get("generation_config")
    passed = sorted(key for key in TREE_FIELDS if key in extra)  # this call's own tree options
    values = {key: _resolve(key, extra, generation_config, self.generation_config) for key in TREE_FIELDS}
    assistant = arguments.get("assistant_model")
    if isinstance(assistant, EagleDraftModel):
        assistant.bind(self)  # a head made for another model is refused here, before any target forward
        assistant.last_stats = None  # set again by a tree= call only: never the stats of an earlier call
    _check_options_used(passed, values["tree"], isinstance(assistant, EagleDraftModel))
    if values["tree"] is None:
        if isinstance(assistant, EagleDraftModel):
            _set_chain_depth(self, arguments, extra, values["tree_depth"])
        return original(self, **arguments, **extra)
    if not isinstance(assistant, EagleDraftModel):
        raise ValueError(
            f"tree={values['tree']!r} needs an EAGLE draft head: pass assistant_model=EagleDraftModel.from_pretrained(...)"
            f" (got {type(assistant).__name__})"
        )
    if arguments.get("custom_generate") is not None:
        raise ValueError("tree= speculation cannot be combined with a custom_generate callable")
    if extra.get("cache_implementation") == "paged":  # transformers switches to continuous batching before us
        raise ValueError('tree= speculation cannot run with cache_implementation="paged" (continuous batching)')
    max_new = extra.get("max_new_tokens", getattr(generation_config, "max_new_tokens", None))
    if max_new is not None and max_new < 1:
        raise ValueError(f"max_new_tokens must be at least 1 for speculative decoding, got {max_new}")
    options = TreeOptions(**{field: values[key] for key, field in TREE_FIELDS.items() if values[key] is not None})

    # transformers drops `tokenizer` when custom_generate is a callable, so stop strings are built here
    tokenizer = extra.pop("tokenizer", None)
    stop_strings = _resolve("stop_strings", extra, generation_config, self.generation_config)
    if stop_strings is not None:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: pass tokenizer=... to generate()")
        criteria = StoppingCriteriaList(arguments.get("stopping_criteria") or [])
        criteria.append(StopStringCriteria(stop_strings=stop_strings, tokenizer=tokenizer))
        arguments["stopping_criteria"] = criteria
        extra["stop_strings"] = None

    # transformers does not hand synced_gpus to a custom_generate callable: pass it on, resolved as generate does,
    # so that the tree loop can refuse it
    synced_gpus = arguments.pop("synced_gpus", None)
    if synced_gpus is None:
        synced_gpus = _distributed_sync_needed(self)
    arguments["custom_generate"] = functools.partial(
        _eagle_custom_generate, draft=assistant, options=options, streamer=arguments.pop("streamer", None),
        synced_gpus=bool(synced_gpus),
    )  # fmt: skip
    arguments["assistant_model"] = None
    return original(self, **arguments, **extra)


def used_tree_options(options: dict) -> dict:
    """`options` (generate kwargs with a `tree`) less those its tree does not read: for callers with defaults for
    every tree option (the CLI, eval-head), which generate would otherwise refuse."""
    return {key: value for key, value in options.items() if key in USED_BY[options["tree"]] or key not in TREE_FIELDS}


def _check_options_used(passed: list[str], tree: str | None, eagle_head: bool) -> None:
    """Raises for a tree option passed to generate that the chosen path would not read (see USED_BY). Options
    that come from a generation config are not checked: pipelines hand on a copy of the model's own config,
    which may hold options for other calls."""
    if tree is None and not eagle_head and passed:
        raise ValueError(f"{', '.join(passed)}: tree speculation options need assistant_model=<EagleDraftModel> "
                         "and tree=...")  # fmt: skip
    unused = [key for key in passed if key not in USED_BY.get(tree, TREE_FIELDS)]
    if unused:
        path = f"tree={tree!r}" if tree is not None else "an EAGLE head without tree= (a chain in the assisted loop)"
        raise ValueError(f"{path} does not use {', '.join(unused)}; it reads only "
                         f"{', '.join(sorted(USED_BY[tree] - {'tree'}))}")  # fmt: skip


def _set_chain_depth(model, arguments: dict, extra: dict, tree_depth) -> None:
    """The stock assisted loop with an EAGLE head: the chain depth is `tree_depth` or `num_assistant_tokens` if the
    caller set one, else DEFAULT_CHAIN_DEPTH (transformers' own default, 20, is meant for assistant models).

    Only what the caller set counts: generate merges transformers' defaults into the config it hands on, so the
    choice is made here, on the kwargs, the generation_config passed and the model's own generation_config. The
    stock options that adapt an assistant model's drafting are refused: the head drafts a fixed-depth chain, and
    tree="eagle2" is the adaptive alternative (its dynamic tree spends the draft budget by confidence).
    """
    passed = arguments.get("generation_config")

    def user_value(key):
        if extra.get(key) is not None:
            return extra[key]
        values = (getattr(config, key, None) for config in (passed, model.generation_config) if config is not None)
        return next((v for v in values if v is not None), None)

    schedule = user_value("num_assistant_tokens_schedule")
    if schedule not in (None, "constant"):
        raise ValueError(
            f"num_assistant_tokens_schedule={schedule!r} adapts an assistant model's draft length between rounds; an "
            f"EAGLE head drafts a fixed chain of num_assistant_tokens (or tree_depth) tokens. Use 'constant', or "
            f'tree="eagle2" for drafts that adapt to the head\'s confidence.'
        )
    if user_value("assistant_confidence_threshold") is not None:
        raise ValueError(
            "assistant_confidence_threshold stops an assistant model's drafting early; an EAGLE head's chain is not "
            'cut by confidence. Leave it unset, or use tree="eagle2", whose tree is built by confidence.'
        )
    tokens = user_value("num_assistant_tokens")
    if tokens is not None and tree_depth is not None and int(tokens) != int(tree_depth):
        raise ValueError(f"num_assistant_tokens={tokens} and tree_depth={tree_depth} disagree: give one")
    depth = int(tree_depth if tree_depth is not None else tokens if tokens is not None else DEFAULT_CHAIN_DEPTH)
    if passed is not None:  # set on a copy: kwargs next to a generation_config are deprecated in transformers
        arguments["generation_config"] = passed = copy.deepcopy(passed)
        passed.num_assistant_tokens = depth
        extra.pop("num_assistant_tokens", None)
    else:
        extra["num_assistant_tokens"] = depth


def _distributed_sync_needed(model) -> bool:
    """What `generate` assumes for synced_gpus=None: DeepSpeed ZeRO-3 or FSDP over more than one rank."""
    import torch.distributed as dist
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from transformers.distributed.fsdp import is_fsdp_managed_module

    return bool(is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model))


def _eagle_custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, *, draft, options, streamer, synced_gpus, **model_kwargs):  # noqa: E501
    return eagle_generate(
        model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
        draft=draft, options=options, streamer=streamer, **model_kwargs,
    )  # fmt: skip
