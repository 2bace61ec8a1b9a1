"""Bad command lines: each ends with one ``specfit: error:`` line that names the key or file, exit 2.

Every line runs in-process through :func:`specfit.cli.main` (a subprocess costs seconds of imports);
two cases run the console script to show it behaves the same. Lines marked EARLY must fail before
any model is loaded: the config checks catch them up front.
"""

from __future__ import annotations

import io
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import specfit.api
from specfit.cli import main

LIMIT_S = 30  # a bad line must fail fast; one that runs on is a bug (the alarm ends it at 3x this)
EARLY, LATE = "early", "late"  # before / after a model is loaded

S = "generate model=tiny prompt_ids=[1,2] max_new_tokens=2"  # a good line the cases spoil
SPEC = f"{S} drafter=eagle3 selector=specfit cost_model=union predictor=history"
EAGLE = f"{S} drafter=eagle3"

# (command line, a substring the error line must hold: the key or file, when the model is built)
CASES: list[tuple[str, str, str]] = [
    # token ids: ints in the vocabulary, no floats, bools, strings or nesting
    ("generate model=tiny prompt_ids=[1.5,2]", "prompt_ids", EARLY),
    ("generate model=tiny prompt_ids=[true,2]", "prompt_ids", EARLY),
    ("generate model=tiny prompt_ids=[[1,2],[3]]", "prompt_ids", EARLY),
    ('generate model=tiny prompt_ids=["a",2]', "prompt_ids", EARLY),
    ("generate model=tiny prompt_ids=[]", "prompt_ids", EARLY),
    ("generate model=tiny prompt_ids=5", "prompt_ids=5: prompt_ids takes a list: prompt_ids=[5]", EARLY),
    ("generate model=tiny prompt_ids=[99999999]", "outside the vocabulary", LATE),
    ("generate model=tiny prompt_ids=[-1]", "outside the vocabulary", LATE),
    (f"{S} stop_token_ids=[1.5]", "stop_token_ids", EARLY),
    (f"{S} stop_token_ids=[abc]", "stop_token_ids", EARLY),
    (f"{S} stop_token_ids=[[1]]", "stop_token_ids", EARLY),
    (f"{S} stop_token_ids=[-3]", "stop_token_ids", LATE),
    (f"{S} stop_token_ids=[999999]", "stop_token_ids", LATE),
    # settings of a plug-in group that is not selected (null) in this config
    (f"{S} cache.capacity=4 acceptance.state_file=/tmp/x.json", "acceptance.state_file: no acceptance plug-in is selected", EARLY),
    (f"{S} cost_model.c0=2", "cost_model.c0: no cost_model plug-in is selected", EARLY),
    # lengths
    ("generate model=tiny prompt_ids=[1] max_new_tokens=0", "max_new_tokens", EARLY),
    ("generate model=tiny prompt_ids=[1] max_new_tokens=-5", "max_new_tokens", EARLY),
    ("generate model=tiny prompt_ids=[1] max_new_tokens=1.5", "max_new_tokens", EARLY),
    ("generate model=tiny prompt_ids=[1] max_new_tokens=abc", "max_new_tokens", EARLY),
    ("generate model=tiny prompt_ids=[1] max_new_tokens=", "max_new_tokens", EARLY),
    (f"{S} model.max_model_len=1", "model.max_model_len", LATE),
    # sampling
    (f"{S} sampling.temperature=-1", "sampling.temperature", EARLY),
    (f"{S} sampling.temperature=nan", "sampling.temperature", EARLY),
    (f"{S} sampling.temperature=inf", "sampling.temperature", EARLY),
    (f"{S} sampling.temperature=hot", "sampling.temperature", EARLY),
    (f"{S} sampling.top_p=0", "sampling.top_p", EARLY),
    (f"{S} sampling.top_p=1.5", "sampling.top_p", EARLY),
    (f"{S} sampling.top_p=nan", "sampling.top_p", EARLY),
    (f"{S} sampling.top_k=-1", "sampling.top_k", EARLY),
    (f"{S} sampling.top_k=2.5", "sampling.top_k", EARLY),
    (f"{S} sampling.seed=1.5", "sampling.seed", EARLY),
    (f"{S} sampling.seed=abc", "sampling.seed", EARLY),
    (f"{S} sampling.temprature=1", "temprature", EARLY),
    (f"{S} sampling=foo", "sampling", EARLY),
    # the drafter
    (f"{EAGLE} drafter.top_k=0", "drafter.top_k", EARLY),
    (f"{EAGLE} drafter.depth=0", "drafter.depth", EARLY),
    (f"{EAGLE} drafter.total_tokens=0", "drafter.total_tokens", EARLY),
    (f"{EAGLE} drafter.eagle_topk=0", "drafter.eagle_topk", EARLY),
    (f"{EAGLE} drafter.num_draft_tokens=1", "drafter.num_draft_tokens", EARLY),
    (f"{EAGLE} drafter.num_steps=-1", "drafter.num_steps", EARLY),
    (f"{EAGLE} drafter.top_k=4 drafter.eagle_topk=5", "drafter.eagle_topk", EARLY),
    (f"{EAGLE} drafter.top_k=100000", "drafter.top_k", EARLY),  # past the tree limits
    (f"{EAGLE} drafter.depth=100000", "drafter.depth", EARLY),  # once drafted to the end of the context
    (f"{EAGLE} drafter.num_draft_tokens=5000", "drafter.total_tokens", EARLY),
    (f"{EAGLE} drafter.path=/nope/head", "drafter.path", EARLY),
    # the model's own head is named by its own key, not as the drafter.path it becomes
    (f"{EAGLE} model.draft_head=/nope/head", "model.draft_head=/nope/head: no such directory", EARLY),
    (f"{EAGLE} model.draft_head={{tmp}}", "model.draft_head={tmp}: no config.json", EARLY),  # so is its contents
    (f"{EAGLE} drafter.seed=x", "drafter.seed", EARLY),
    (f"{EAGLE} drafter.topk=3", "did you mean drafter.top_k?", EARLY),
    (f"{EAGLE} +drafter.depht=3", "did you mean drafter.depth?", EARLY),
    # a setting of another plug-in of the group: named by the plug-in chosen, not its config class
    (f"{S} drafter.top_k=3", "drafter=none has no setting 'top_k' (it has no settings)", EARLY),
    (f"{S} workload=prose workload.foo=1", "workload has no setting 'foo' (its settings: kind,", EARLY),  # not a plug-in
    (f"{S} drafter=eagle3 selector=greedy cost_model=union predictor=history selector.objective=rate",
     "selector=greedy has no setting 'objective' (its settings:",
     EARLY),
    # the cache and copy engine
    (f"{S} cache.capacity=0", "cache.capacity", EARLY),
    (f"{S} cache.capacity=-3", "cache.capacity", EARLY),
    (f"{S} cache.capacity=1", "cache.capacity", LATE),  # below the model's top-k
    (f"{S} cache.capacity_bytes=0", "cache.capacity_bytes", EARLY),
    (f"{S} cache.capacity=4 cache.capacity_bytes=1000000", "cache.capacity_bytes", EARLY),
    (f"{S} cache.capacity=many", "cache.capacity", EARLY),
    (f"{S} cache.copy=foo", "cache.copy", EARLY),
    (f"{S} cache.capacit=3", "capacit", EARLY),
    (f"{S} cache.copy=emulated cache.link.profile=nope", "cache.link.profile", EARLY),
    (f"{S} cache.copy=emulated cache.link.bandwidth_gbps=0", "cache.link.bandwidth_gbps", EARLY),
    (f"{S} cache.copy=emulated cache.link.latency_us=-5", "cache.link.latency_us", EARLY),
    (f"{S} cache.copy=emulated cache.link.ref_expert_bytes=-1", "cache.link.ref_expert_bytes", EARLY),
    (f"{S} cache.copy=emulated cache.link.profile=null", "cache.link.bandwidth_gbps", EARLY),
    # the model
    (f"{S} model.dtype=int8", "model.dtype", LATE),
    (f"{S} model.device=tpu", "model.device", LATE),
    (f"{S} model.attn_implementation=flash", "model.attn_implementation", LATE),
    (f"{S} model.builtin=nope", "model.builtin", LATE),
    (f"{S} model.seed=abc", "model.seed", EARLY),
    (f"{S} model.path=/nope/model model.builtin=null", "model.path", LATE),
    ("generate model=tiny model.tokenizer=/nope/tok prompt=Hi", "model.tokenizer=/nope/tok: no such directory", LATE),
    ("generate prompt_ids=[1]", "model.path", LATE),
    # config groups, and keys that do not exist (also added with + / ++), or are removed with ~
    (f"{S} selector=nope", "selector/nope", EARLY),
    (f"{S} drafter=nope", "drafter/nope", EARLY),
    (f"{S} cache=nope", "cache/nope", EARLY),
    (f"{S} workload=nope", "workload/nope", EARLY),
    ("generate model=nope prompt_ids=[1]", "model/nope", EARLY),
    (f"{S} +foo=1", "'foo'", EARLY),
    (f"{S} ++foo=1", "'foo'", EARLY),
    (f"{S} +drafter.foo=1", "drafter.foo", EARLY),
    (f"{S} +model.foo=1", "model.foo", EARLY),
    (f"{S} +sampling.foo=1", "sampling.foo", EARLY),
    (f"{S} +cache.link.foo=1", "cache.link.foo", EARLY),
    (f"{S} +workload.foo=1", "workload.foo", EARLY),
    (f"{S} foo=1", "'foo'", EARLY),
    (f"{S} drafter.foo=1", "drafter.foo", EARLY),
    (f"{S} ~model", "model", EARLY),
    (f"{S} ~sampling", "sampling", EARLY),
    (f"{S} ~cache", "cache", EARLY),
    (f"{S} key_without_value", "key_without_value", EARLY),
    ("generate model=tiny prompt_ids=[1", "[1", EARLY),
    ("generate model=demo prompt=Tom – and 5 more", "prompt_file", EARLY),  # Hydra needs non-ASCII quoted
    (f"{S} verbose=maybe", "verbose", EARLY),
    # selector, cost model and predictor options
    (f"{S} selector=specfit", "cost_model", LATE),
    (f"{SPEC} selector.acceptance=foo", "selector.acceptance", EARLY),
    (f"{S} cache.capacity=a=b", "cannot parse 'cache.capacity=a=b': mismatched input", EARLY),
    (f"{S} cost_model=null", "cost_model=null: cost_model is a group of options", EARLY),
    (f"{S} results_file=", "results_file is empty", EARLY),
    (f"{SPEC} cost_model.calibration={{tmp}}", "cost_model.calibration={tmp}: is a directory", LATE),
    (f"{S} prefetch=[lookahead,draft]", "prefetch takes one option, not a list (prefetch=auto combines", EARLY),
    ("bench model=demo methods=[ar] workload=[prose,gsm]", "workload takes one option, not a list (several "
     "workloads: workloads=[...]", EARLY),
    (f"{S} cache=null", "cache=null: cache is a group of options: choose one (cache=NAME", EARLY),
    ("demo model=tiny workload=gsm", "workload: specfit demo decodes its shipped prompts", EARLY),
    (f"{SPEC} selector.draft_time=foo", "selector.draft_time", EARLY),
    (f"{SPEC} selector.gate_max_backoff=0", "selector.gate_max_backoff", EARLY),
    (f"{SPEC} predictor.max_keys=0", "predictor.max_keys", EARLY),
    (f"{SPEC} predictor.prior=-1", "predictor.prior", EARLY),
    (f"{SPEC} predictor.pair_weight=nan", "predictor.pair_weight", EARLY),
    (f"{SPEC} cost_model.c_tok=-1", "cost_model.c_tok", EARLY),
    (f"{SPEC} cost_model.c_miss=inf", "cost_model.c_miss", EARLY),
    (f"{SPEC} cost_model.calibration=", "cost_model.calibration", EARLY),
    (f"{SPEC} cost_model.calibration=/nope/calibration.json", "cost_model.calibration", LATE),
    (f"{S} predictor=oracle", "predictor=oracle", LATE),
    (f"{SPEC} acceptance=oracle", "acceptance=oracle", LATE),
    # prompts
    ("generate model=tiny prompt=hi prompt_ids=[1]", "prompt_ids", EARLY),
    ("generate model=tiny prompt=hi", "prompt_ids", LATE),  # no tokenizer: the ids are the way
    ("demo model=tiny max_new_tokens=2", "tokenizer", LATE),  # text prompts: refused before any calibration
    ("generate model=tiny workload=gsm", "tokenizer", LATE),
    ("generate model=tiny prompt_file=/nope/prompt.txt", "prompt_file=/nope/prompt.txt", EARLY),
    ("generate model=tiny prompt_file={tmp}", "prompt_file", EARLY),  # a directory
    ("generate model=tiny prompt_file={tmp}/utf8.txt prompt=hi", "prompt_file", EARLY),
    ("generate model=demo prompt_file={tmp}/latin1.txt", "latin1.txt", EARLY),  # read before the model loads
    ("generate model=demo prompt_file={tmp}/empty.txt", "empty.txt", EARLY),  # read before the model loads
    # workloads
    ("generate model=tiny workload=jsonl", "workload.path", EARLY),
    ("generate model=tiny workload=jsonl workload.path=/nope/w.jsonl", "workload.path", EARLY),
    (f"{S} workload.kind=nope", "workload.kind", EARLY),
    (f"{S} workload.num_prompts=0", "workload.num_prompts", EARLY),
    (f"{S} workload.max_prompts=0", "workload.max_prompts", EARLY),
    (f"{S} workload.num_prompts=3", "use workload.max_prompts=3", EARLY),  # inline/jsonl take all their prompts
    ("demo workload.num_prompts=1", "use workload.max_prompts=1", EARLY),
    (f"{S} workload=prose", "give prompt_ids or workload, not both", EARLY),
    (f"{S} workloads=[inline,gsm]", "specfit generate decodes with the config's own parts, so workloads (a comparison "
                                    "setting) does not apply", EARLY),
    (f"{S} methods=[ar,eagle3]", "so methods (a comparison setting) does not apply; compare methods with specfit bench", EARLY),
    (f"{S} +method_presets.mine=[x]", "so method_presets (a comparison setting) does not apply", EARLY),
    ("generate model=tiny prompt=Hello world", "'world' is not a key=value setting: the shell split prompt=Hello world "
                                               "at a space; quote the whole setting, 'prompt=Hello world'", EARLY),
    ("generate model=tiny prompt=Hello, world", "a comma makes the value a list for Hydra; quote it inside the shell's "
                                                "quotes, 'prompt=\"Hello, world\"'; or read the prompt from standard input", EARLY),
    ("generate world model=tiny", "'world' is not a key=value setting (e.g. model=demo", EARLY),
    ("generate -m model=tiny prompt_ids=[1] max_new_tokens=2 workload=prose", "not both", EARLY),  # each sweep job
    # an override Hydra's grammar refuses: how to quote it, with its own key
    ("generate model=tiny model.path=~/x prompt_ids=[1]", "cannot parse model.path=~/x (quote a value", EARLY),
    ("generate model=tiny 'prompt=a~b c'", "prompt_file=PATH", EARLY),
    ("generate model=tiny 'prompt=He said, yes'", "a comma is ambiguous: a list is prompt=[A,B]", EARLY),
    ("bench model=tiny prompt_ids=[1] '+method_presets.mine=[selector=chain]' methods=[mine]",
     "an entry holding '=' is quoted inside the list", EARLY),
    # argparse stops reading settings at a flag between them: say that, not "unrecognized arguments"
    ("generate model=tiny --cfg job prompt_ids=[1]", "come after a Hydra flag that ends the settings", EARLY),
    ("generate --bogus", "unrecognized arguments: --bogus", EARLY),
    # a bad value in a later job of a sweep is named before the first job runs
    ("generate -m model=tiny prompt_ids=[1] max_new_tokens=2,0", "max_new_tokens=0", EARLY),
    ("generate -m model=tiny prompt_ids=[1] max_new_tokens=2 sampling.temperature=0,-1", "sampling.temperature", EARLY),
    ("generate model=demo prompt=hi workload.seed=2", "give prompt or workload.seed, not both", EARLY),
    ("bench model=tiny prompt_ids=[1] methods=[ar] workloads=[gsm]", "not both", EARLY),
    # every workload of the list takes all its prompts: num_prompts would do nothing
    ("bench model=tiny methods=[ar] workloads=[inline] workload.prompt_ids=[[1,2]] workload.num_prompts=3",
     "use workload.max_prompts=3", EARLY),
    # bench, demo, record, replay, calibrate, trainers
    ("bench model=tiny prompt_ids=[1] methods=[nope]", "nope", EARLY),
    ("bench model=tiny prompt_ids=[1] methods=[ar,ar_prefetch] prefetch.gat=false",
     "no method of methods=['ar', 'ar_prefetch'] takes it; in ar_prefetch (prefetch=auto): Could not override "
     "'prefetch.gat'. Key 'gat' not in 'AutoPrefetcherConfig'; did you mean prefetch.gate?", EARLY),
    # a sweep cannot move an override only some methods take into their presets: it says so
    ("bench -m model=tiny prompt_ids=[1] methods=[ar,ar_prefetch] prefetch.gate=false,true",
     "only applies to some methods (ar_prefetch): a plain run moves it into their presets, a -m sweep cannot", EARLY),
    ("bench -m model=tiny prompt_ids=[1] methods=[ar,ar_prefetch] prefetch.gat=false,true",
     "no method of methods=['ar', 'ar_prefetch'] takes it", EARLY),
    ("bench model=tiny prompt_ids=[1] methods=[ar,eagle3,ar]", "methods=['ar', 'eagle3', 'ar'] names ar more than once",
     EARLY),
    ("bench model=tiny prompt_ids=[1] methods=ar", "methods=ar: methods takes a list: methods=[ar]", EARLY),
    ("replay trace.path=/nope replay.cost_profile=gpu-like cost_model.calibration=/tmp/c.json",
     "cost_model.calibration and replay.cost_profile=gpu-like both set", EARLY),  # the calibration was ignored
    # keys only other commands read (they changed nothing here, silently)
    (f"{S} replay.cost_profile=gpu-like", "replay.cost_profile: only specfit replay reads it; specfit generate", EARLY),
    ("bench model=tiny prompt_ids=[1] trace.path=/tmp/t", "trace.path: only specfit record and specfit replay", EARLY),
    ("bench model=tiny prompt_ids=[1] methods=[ar] repeats=0", "repeats", EARLY),
    ("bench model=tiny prompt_ids=[1] methods=[ar] repeats=1.5", "repeats", EARLY),
    ("bench model=tiny prompt_ids=[1] methods=[ar] warmup=-1", "warmup", EARLY),
    ("bench model=tiny prompt_ids=[1] methods=[ar] baseline=nope", "baseline", EARLY),
    ("bench model=tiny prompt_ids=[1] methods=[ar] baseline=eagle3", "baseline=eagle3 is not among methods", EARLY),
    ("bench model=tiny prompt_ids=[1] drafter.topk=3", "topk", EARLY),
    ("bench model=tiny methods=[ar] workloads=[gsm] workload=prose", "give workload=NAME or workloads=[...], not both",
     EARLY),
    ("bench model=tiny methods=[ar] workloads=[prosee]", "workloads=['prosee']: 'prosee' is not a workload", EARLY),
    ("generate model=demo workload=prose workload.kind=gsm max_new_tokens=2",
     "workload.kind=gsm contradicts workload=prose (kind prose)", EARLY),
    ("generate model=demo workload=prose workload.split=train max_new_tokens=2",
     "workload.split=train does not apply to workload=prose (kind prose): only kind=hf reads it", EARLY),
    ("generate model=demo workload=gsm workload.prompt_chars=20 max_new_tokens=2",
     "workload.prompt_chars=20 does not apply to workload=gsm", EARLY),
    ("bench model=tiny methods=[ar] workloads=[gsm] workload.prompt_chars=300",
     "workload.prompt_chars=300 does not apply to workloads=['gsm']", EARLY),
    ("bench model=tiny methods=[ar] workloads=[prose,gsm,prose]", "workloads=['prose', 'gsm', 'prose'] names prose "
     "more than once", EARLY),
    ("bench model=tiny methods=[ar] workloads=[gsm] workload.kind=prose workload.num_prompts=1",
     "workload.kind=prose contradicts workloads=['gsm']", EARLY),
    ("""bench model=tiny prompt_ids=[1] methods=[ar,bad] '+method_presets.bad=["selector=nope"]'""",
     "method_presets.bad=['selector=nope']: does not compose", EARLY),
    ("""bench model=tiny prompt_ids=[1] methods=[ar,bad] '+method_presets.bad=["selector=nope"]' drafter.top_k=3""",
     "method_presets.bad=['selector=nope']: does not compose", EARLY),
    ("demo methods=[ar,nope]", "nope", EARLY),
    ("demo repeats=0", "repeats", EARLY),
    ("demo +foo=1", "'foo'", EARLY),
    ("record model=tiny prompt_ids=[1] max_new_tokens=2 sampling.temperature=1", "sampling.temperature", EARLY),
    ("record model=tiny prompt_ids=[1] max_new_tokens=2 selector=chain", "selector: specfit record records with its "
     "own selector (every node any selector could verify) and predicts nothing, so selector does not apply", EARLY),
    ("record model=tiny prompt_ids=[1] max_new_tokens=2 predictor.prior=0.3", "predictor.prior: specfit record", EARLY),
    ("record model=tiny prompt_ids=[1] max_new_tokens=2 resume=true trace.overwrite=true",
     "resume=true continues the trace at trace.path and trace.overwrite=true replaces it: give one", EARLY),
    ("replay", "trace.path", EARLY),
    ("replay trace.path=/nope/trace", "trace.path", EARLY),
    ("replay trace.path=/nope/trace replay.draft_time=foo", "replay.draft_time", EARLY),
    ("replay trace.path=/nope/trace replay.warmup=-1", "replay.warmup", EARLY),
    ("replay trace.path=/nope/trace sampling.temperature=0.5", "sampling.temperature: specfit replay", EARLY),
    ("replay trace.path=/nope/trace max_new_tokens=2", "max_new_tokens: specfit replay", EARLY),
    ("replay trace.path=/nope/trace workload=prose", "workload: specfit replay", EARLY),
    ("replay trace.path=/nope/trace cache.link.bandwidth_gbps=1", "cache.link.bandwidth_gbps: specfit replay copies "
     "nothing and charges every cycle with its cost model", EARLY),
    ("replay trace.path=/nope/trace cache.copy=torch", "cache.copy: specfit replay copies nothing", EARLY),
    # a key only one preset's drafter has is not folded into that preset: a replay cannot apply it
    ("replay trace.path=/nope/trace methods=[ar,ngram] drafter.min_match=3",
     "drafter.min_match: specfit replay replays the trees drafted", EARLY),
    ("calibrate model=tiny cost_model=nope", "cost_model/nope", EARLY),
    ("calibrate model=tiny max_new_tokens=0", "max_new_tokens", EARLY),
    ("train-target nope=1", "nope", EARLY),
    ("train-drafter +nope=1", "nope", EARLY),
    # the trainers' paths and values: one line naming the key (not transformers' repo-id words), exit 2
    ("train-drafter target_dir=/nope/target out_dir={tmp}/t1", "target_dir=/nope/target: no such directory", EARLY),
    ("train-drafter target_dir=specfit/assets/demo/target tokenizer_dir=/nope/tok out_dir={tmp}/t2",
     "tokenizer_dir=/nope/tok: no such directory", EARLY),
    ("train-drafter target_dir=specfit/assets/demo/target init_from=/nope/head out_dir={tmp}/t3",
     "init_from=/nope/head: no such directory", EARLY),
    ("train-drafter save_dtype=fp8 out_dir={tmp}/t4", "save_dtype='fp8' is not one of", EARLY),
    ("train-drafter train_files=[/nope/a.txt] out_dir={tmp}/t11", "train_files: /nope/a.txt: no such file", EARLY),
    ("train-drafter target_dir=specfit/assets/demo/target aux_layers=[1,2,9] out_dir={tmp}/t13",
     "aux_layers=[1, 2, 9]: HF hidden_states indices must be in [1, 6]", EARLY),
    ("train-target train_files=[{tmp}] out_dir={tmp}/t12", "is a directory, not a file", EARLY),
    ("train-target tokenizer_dir=specfit/assets/demo/target num_key_value_heads=4 out_dir={tmp}/t5",
     "num_attention_heads=6 must be a multiple of num_key_value_heads=4", EARLY),
    ("train-target tokenizer_dir=specfit/assets/demo/target seq_len=4096 out_dir={tmp}/t6",
     "seq_len=4096 exceeds max_position_embeddings=2048", EARLY),
    ("train-target tokenizer_dir=specfit/assets/demo/target device=gpu out_dir={tmp}/t7", "device='gpu'", EARLY),
    ("train-drafter target_dir=specfit/assets/demo/target device=gpu out_dir={tmp}/t8", "device='gpu'", EARLY),
    ("train-drafter target_dir={tmp} out_dir={tmp}/t9", "target_dir={tmp}: no config.json there", EARLY),
    ("train-target tokenizer_dir={tmp}/utf8.txt out_dir={tmp}/t10", "tokenizer_dir={tmp}/utf8.txt: is a file", EARLY),
    ("eval-target model_dir={tmp} out={tmp}/e1.json", "model_dir={tmp}: no config.json there", EARLY),
    ("eval-target model_dir=specfit/assets/demo/target seq_len=4096 out={tmp}/e2.json",
     "seq_len=4096 exceeds the model's context: max_position_embeddings=2048", EARLY),
    ("eval-target model_dir=specfit/assets/demo/target n_prompts=0 out={tmp}/e3.json", "n_prompts=0", EARLY),
    ("eval-target model_dir=specfit/assets/demo/target gen_tokens=2 out={tmp}/e4.json", "gen_tokens=2", EARLY),
    ("fit-acceptance trace.path={tmp}/trace held_out=[{tmp}/trace/] out_dir={tmp}/fit",
     "held_out: {tmp}/trace/ is the training trace", EARLY),
    # a path that is a file, where a directory is wanted
    (f"{EAGLE} drafter.path={{tmp}}/utf8.txt", "drafter.path={tmp}/utf8.txt: is a file, not a directory", EARLY),
    ("replay trace.path={tmp}/utf8.txt", "trace.path={tmp}/utf8.txt: is a file, not a directory", EARLY),
    ("generate model=tiny workload=prose workload.data_dir={tmp}/utf8.txt max_new_tokens=2",
     "utf8.txt is a file, not a directory", EARLY),
    # a sweep: each job's config is checked too
    ("generate -m model=tiny prompt_ids=[1] max_new_tokens=2 cache.capacity=0,4", "cache.capacity", EARLY),
    # flags, commands and the argparse commands
    (f"{S} --nope", "--nope", EARLY),
    (f"{S} --cfg nope", "--cfg", EARLY),
    ("nope", "unknown command 'nope'", EARLY),
    ("generat model=tiny", "unknown command 'generat'", EARLY),
    ("report", "results", EARLY),
    ("report /nope/results.jsonl", "/nope/results.jsonl", EARLY),
    ("report --out", "--out", EARLY),
    ("plugins --nope", "--nope", EARLY),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("prompts")
    (folder / "utf8.txt").write_text("Bonjour – café ☕\n", encoding="utf-8")
    (folder / "latin1.txt").write_bytes("café".encode("latin-1"))
    (folder / "empty.txt").write_bytes(b"\n")
    return folder


class _Hang(Exception):
    pass


def run_cli(argv: list[str], capsys) -> tuple[int, str, str, float]:
    """``main(argv)`` in-process: (exit status, stdout, stderr, seconds); an alarm ends a hang."""

    def hang(*_):
        raise _Hang(f"still running after {3 * LIMIT_S} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(3 * LIMIT_S)
    start = time.perf_counter()
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    seconds = time.perf_counter() - start
    out, err = capsys.readouterr()
    return code, out, err, seconds


def _argv(line: str, run_dir: Path, folder: Path) -> list[str]:
    argv = shlex.split(line.replace("{tmp}", str(folder)))
    if argv[0] in ("generate", "bench", "demo", "record", "replay", "calibrate", "train-target", "train-drafter",
                   "eval-target", "fit-acceptance"):
        key = "hydra.sweep.dir" if "-m" in argv else "hydra.run.dir"
        argv.append(f"{key}={run_dir}")
    return argv


def test_a_trainer_with_a_mistyped_path_writes_nothing(tmp_path, capsys):
    """The paths are checked before out_dir is created (and before an earlier run's log is dropped)."""
    for trainer, key in (("train-drafter", "target_dir"), ("train-target", "tokenizer_dir")):
        out = tmp_path / trainer
        code, _, err, _ = run_cli([trainer, f"{key}=/nope/x", f"out_dir={out}", f"hydra.run.dir={tmp_path / 'run'}"],
                                  capsys)
        assert code == 2 and f"{key}=/nope/x: no such directory" in err, err
        assert not out.exists()


def test_a_directory_without_a_saved_model_writes_nothing(tmp_path, capsys):
    """A directory with tokenizer files but no config.json is no saved model: named before out_dir is made."""
    folder = tmp_path / "tokenizer-only"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((Path("specfit/assets/demo/target") / name).read_bytes())
    for command, key, out in (("train-drafter", "target_dir", "out_dir"), ("eval-target", "model_dir", "out")):
        dest = tmp_path / command
        code, _, err, _ = run_cli([command, f"{key}={folder}", f"{out}={dest}", f"hydra.run.dir={tmp_path / 'run'}"],
                                  capsys)
        assert code == 2 and f"{key}={folder}: no config.json there, so no saved model" in err, err
        assert not dest.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize(("trainer", "key"), [("train-target", "tokenizer_dir"), ("train-drafter", "target_dir")])
def test_a_trainer_on_cuda_without_cuda_is_one_line(trainer, key, tmp_path, capsys):
    code, _, err, _ = run_cli([trainer, "device=cuda", f"{key}=specfit/assets/demo/target", f"out_dir={tmp_path / 'out'}",
                               f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert code == 2 and "device='cuda': no CUDA device is available" in err, err
    assert not (tmp_path / "out").exists()


def test_the_table_is_large_and_mostly_early():
    assert len(CASES) >= 100
    assert len({c[0] for c in CASES}) == len(CASES), "duplicate lines"
    assert sum(c[2] == EARLY for c in CASES) >= 0.75 * len(CASES)


@pytest.mark.parametrize(("line", "needle", "stage"), CASES, ids=[c[0][:90] for c in CASES])
def test_bad_line_is_one_clear_error(line, needle, stage, files, tmp_path, capsys, monkeypatch):
    loads = []
    real = specfit.api.load_target
    monkeypatch.setattr(specfit.api, "load_target", lambda cfg: loads.append(cfg) or real(cfg))
    code, out, err, seconds = run_cli(_argv(line, tmp_path, files), capsys)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2, (code, err[-2000:])
    assert len(lines) == 1, err[-2000:]
    assert lines[0].startswith("specfit: error: "), lines[0]
    assert needle.replace("{tmp}", str(files)) in lines[0], lines[0]
    assert "Traceback" not in err and "Traceback" not in out
    assert seconds < LIMIT_S
    assert (len(loads) > 0) == (stage == LATE), f"expected to fail {stage}: {len(loads)} model(s) loaded"


@pytest.mark.parametrize("line", [f"{S} cache.capacity=4.5", "bench model=tiny prompt_ids=[1] methods=ar"])
def test_a_bad_value_of_an_existing_key_suggests_no_key(line, tmp_path, capsys):
    """`did you mean X?` is for a misspelt key; a bad value of X itself must not suggest X."""
    code, _, err, _ = run_cli(_argv(line, tmp_path, tmp_path), capsys)
    assert code == 2 and "did you mean" not in err, err


def test_prompt_file_from_bad_standard_input(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe not utf-8")))
    code, _, err, _ = run_cli(["generate", "model=demo", "prompt_file=-", f"hydra.run.dir={tmp_path}"], capsys)
    assert code == 2 and err.strip() == (
        "specfit: error: prompt_file=- (standard input) is not UTF-8 text (byte 0: b'\\xff'); "
        "convert it, e.g. with iconv -t utf-8")


def test_prompt_file_reads_utf8_text(files, monkeypatch):
    """No quoting: the file's text is the prompt (one final line break dropped), from a file or stdin."""
    from specfit.commands.generate import read_prompt_file

    assert read_prompt_file(str(files / "utf8.txt")) == "Bonjour – café ☕"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("«naïve»\r\n".encode())))
    assert read_prompt_file("-") == "«naïve»"


def test_prompt_file_is_decoded_like_the_prompt_key(tmp_path, capsys):
    """prompt_file=PATH gives the same output as prompt="..." with the same text (the demo pair's tokenizer)."""
    text = "Question: Tom has 3 apples – and 5 more. Answer:"
    (tmp_path / "p.txt").write_text(text + "\n", encoding="utf-8")
    common = ["generate", "model=demo", "max_new_tokens=4", f"hydra.run.dir={tmp_path}"]
    code_a, out_a, _, _ = run_cli([*common, f"prompt='{text}'"], capsys)  # quoted for Hydra (the en dash)
    code_b, out_b, _, _ = run_cli([*common, f"prompt_file={tmp_path / 'p.txt'}"], capsys)
    assert code_a == code_b == 0
    assert out_a.splitlines()[0] == out_b.splitlines()[0]


@pytest.mark.parametrize("verbose", ["arg", "env"])
def test_verbose_shows_the_traceback(verbose, monkeypatch, capsys, tmp_path):
    argv = ["generate", "model=tiny", "prompt_ids=[1]", "sampling.top_p=2", f"hydra.run.dir={tmp_path}"]
    if verbose == "arg":
        argv.append("verbose=true")
    else:
        monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    code, _, err, _ = run_cli(argv, capsys)
    assert code == 2 and "Traceback" in err
    assert err.strip().splitlines()[-1] == "specfit: error: sampling.top_p=2.0 must be in (0, 1]"


def test_verbose_is_accepted_by_the_trainers_too(capsys):
    code, _, err, _ = run_cli(["train-target", "verbose=true", "nope=1"], capsys)
    assert code == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("specfit: error:")


def _broken_run(exc: BaseException):
    def run(*args, **kwargs):
        raise exc

    return run


def test_ctrl_c_is_one_line_exit_130(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("specfit.commands.generate.run", _broken_run(KeyboardInterrupt()))
    code, _, err, _ = run_cli(["generate", "model=tiny", "prompt_ids=[1]", f"hydra.run.dir={tmp_path}"], capsys)
    assert code == 130 and err.strip() == "specfit: interrupted"


def test_ctrl_c_may_say_how_to_resume(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("specfit.commands.generate.run", _broken_run(KeyboardInterrupt("resume with: specfit x")))
    code, _, err, _ = run_cli(["generate", "model=tiny", "prompt_ids=[1]", f"hydra.run.dir={tmp_path}"], capsys)
    assert code == 130 and err.strip() == "specfit: interrupted; resume with: specfit x"


def test_a_bug_is_one_line_exit_1(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("specfit.commands.generate.run", _broken_run(IndexError("list index out of range")))
    code, _, err, _ = run_cli(["generate", "model=tiny", "prompt_ids=[1]", f"hydra.run.dir={tmp_path}"], capsys)
    assert code == 1
    assert err.strip() == ("specfit: internal error: IndexError: list index out of range "
                           "(run with verbose=true for the traceback)")


def test_a_bug_in_a_sweep_job_is_not_swallowed(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("specfit.commands.generate.run", _broken_run(RuntimeError("boom")))
    code, _, err, _ = run_cli(["generate", "-m", "model=tiny", "prompt_ids=[1]", "max_new_tokens=1,2",
                               f"hydra.sweep.dir={tmp_path}"], capsys)
    assert code == 1 and err.strip().startswith("specfit: internal error: RuntimeError: boom")


def test_an_os_error_is_a_user_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("specfit.commands.generate.run", _broken_run(PermissionError(13, "Permission denied", "/x/y")))
    code, _, err, _ = run_cli(["generate", "model=tiny", "prompt_ids=[1]", f"hydra.run.dir={tmp_path}"], capsys)
    assert code == 2 and err.strip() == "specfit: error: /x/y: Permission denied"


def test_a_reader_that_leaves_early_gets_no_error(monkeypatch, capsys):
    """`specfit plugins --json | head -1`: the closed pipe ends the command quietly (exit 1, no error line)."""
    def broken_pipe(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("specfit.commands.plugins.run", broken_pipe)
    with pytest.raises(SystemExit) as info:
        main(["plugins", "--json"])
    assert info.value.code == 1 and capsys.readouterr().err == ""


@pytest.mark.parametrize(("argv", "needle"), [
    (["generate", "model=tiny", "prompt_ids=[1]", "+drafter.foo=1"], "drafter.foo"),
    (["nope"], "unknown command 'nope'"),
])
def test_the_console_script_behaves_the_same(argv, needle, tmp_path):
    exe = Path(sys.executable).with_name("specfit")
    run_dir = [f"hydra.run.dir={tmp_path}"] if argv[0] == "generate" else []
    done = subprocess.run([exe, *argv, *run_dir], capture_output=True, text=True, timeout=120)
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("specfit: error:") and needle in lines[0]


def test_bench_refuses_a_prompt_past_the_context_before_decoding_any(tmp_path, capsys):
    """The second prompt is too long: the bench stops before the first one runs (no row written)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3]}\n{"prompt_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9]}\n')
    with pytest.raises(SystemExit) as exc:
        main(["bench", "model=tiny", "model.max_model_len=8", "workload=jsonl", f"workload.path={prompts}",
              "methods=[ar]", "max_new_tokens=2", f"hydra.run.dir={tmp_path / 'run'}"])
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err[-1].startswith("specfit: error:") and "context limit is 8" in err[-1], err
    assert not any((tmp_path / "run").rglob("results.jsonl"))


def test_a_run_folder_that_cannot_be_created_names_hydra_run_dir(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    run_dir = tmp_path / "file" / "run"
    code, _, err, _ = run_cli(["generate", "model=tiny", "prompt_ids=[1]", f"hydra.run.dir={run_dir}"], capsys)
    assert code == 2 and err.strip() == (f"specfit: error: hydra.run.dir={run_dir}: cannot create the run folder: "
                                         "Not a directory")


@pytest.mark.parametrize("overrides", [["prompt=hi", "workload='inline'"], ["prompt=hi", "workloads=[]"],
                                       ["prompt=null", "workload=prose"], ["prompt_ids=[1]", "workloads=[inline]"]])
def test_a_prompt_beside_no_real_workload_is_accepted(overrides):
    """Hydra's parse decides (quotes, empty lists, null), not the raw text of the override."""
    from specfit.cli import _check_prompt_or_workload, _override_values

    _check_prompt_or_workload(_override_values(overrides))


def test_a_quoted_run_folder_is_created_where_hydra_puts_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "q b"
    code, _, _, _ = run_cli(["generate", "model=tiny", "prompt_ids=[1]", "max_new_tokens=1",
                             f"hydra.run.dir='{run_dir}'"], capsys)
    assert code == 0 and (run_dir / "results.jsonl").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["q b"]  # no folder named after the quoted text


def test_a_bad_prompt_of_a_workload_file_is_named_by_file_and_position(tmp_path, capsys):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [99999]}\n')
    code, _, err, _ = run_cli(["generate", "model=tiny", "workload=jsonl", f"workload.path={f}", "max_new_tokens=2",
                               f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert code == 2 and f"workload.path={f}, prompt 2 of 2: prompt: token ids [99999]" in err, err


def test_a_sweep_folder_that_cannot_be_made_is_named(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err, _ = run_cli(["generate", "-m", "model=tiny", "prompt_ids=[1]", "max_new_tokens=2,3",
                               f"hydra.sweep.dir={blocker}/x"], capsys)
    assert code == 2 and f"hydra.sweep.dir={blocker}/x: cannot create the run folder" in err, err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a device whose writes fail)")
def test_a_results_file_that_cannot_be_written_is_named(tmp_path, capsys):
    code, _, err, _ = run_cli(["generate", "model=tiny", "prompt_ids=[1,2,3]", "max_new_tokens=2",
                               "results_file=/dev/full", f"hydra.run.dir={tmp_path}"], capsys)
    assert code == 2 and "/dev/full: cannot append the results to it (No space left on device)" in err, err


def test_a_key_given_twice_is_noted_and_the_last_applies(tmp_path, capsys):
    main(["generate", "model=tiny", "prompt_ids=[1,2,3]", "max_new_tokens=4", "max_new_tokens=2",
          f"hydra.run.dir={tmp_path}"])
    captured = capsys.readouterr()
    assert "max_new_tokens is given twice (max_new_tokens=4, then max_new_tokens=2): the last one applies" in captured.err
    assert "tokens=2 " in captured.out
