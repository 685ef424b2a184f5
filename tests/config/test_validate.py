"""Cross-field validation: every bad layout or value is one ConfigError naming the numbers."""

from __future__ import annotations

import pytest

from megalite.config import ConfigError, OptimizerConfig, validate

from ..helpers import tiny_config


def test_tiny_config_is_valid_on_several_world_sizes():
    for world, tp in [(1, 1), (2, 2), (4, 2), (4, 4), (8, 2)]:
        validate(tiny_config(tp=tp), world)
        validate(tiny_config(tp=tp, model={"fp8_format": "hybrid"}, training={"bf16": True}), world)
        validate(tiny_config(tp=tp, model={"fp8_format": "hybrid", "fp8_param_gather": True},
                             optimizer={"use_distributed_optimizer": True}, training={"bf16": True}), world)


@pytest.mark.parametrize("cfg, world, message", [
    (tiny_config(tp=3), 4, "world size 4 is not divisible by --tensor-model-parallel-size 3"),
    (tiny_config(tp=8), 8, "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"),
    (tiny_config(pp=3), 3, "--num-layers 2 is not divisible by --pipeline-model-parallel-size 3 x virtual stages 1"),
    (tiny_config(pp=2, model={"num_layers": 8}, parallel={"num_virtual_stages_per_pipeline_rank": 2},
                 training={"global_batch_size": 6}), 2,
     "number of micro-batches (--global-batch-size 6 / (--micro-batch-size 2 x data-parallel size 1) = 3) to be a "
     "multiple of --pipeline-model-parallel-size 2: use a global batch size that is a multiple of 4, e.g. 8"),
    (tiny_config(pp=2, model={"num_layers": 8}, parallel={"num_layers_per_virtual_pipeline_stage": 3}), 2,
     "--num-layers 8 is not divisible by --num-layers-per-virtual-pipeline-stage 3 x --pipeline-model-parallel-size 2"),
    (tiny_config(pp=2, model={"num_layers": 8}, parallel={"num_layers_per_virtual_pipeline_stage": 2,
                                                          "num_virtual_stages_per_pipeline_rank": 3}), 2,
     "--num-virtual-stages-per-pipeline-rank 3 disagrees with --num-layers-per-virtual-pipeline-stage 2"),
    (tiny_config(model={"num_layers": 8}, parallel={"num_virtual_stages_per_pipeline_rank": 2}), 1,
     "virtual pipeline stages (2) need --pipeline-model-parallel-size > 1"),
    (tiny_config(pp=2, parallel={"pipeline_schedule": "zb-h2"}), 2,
     "--pipeline-schedule must be 1f1b, zero-bubble or zbv, got 'zb-h2'"),
    (tiny_config(parallel={"pipeline_schedule": "zero-bubble"}), 1,
     "--pipeline-schedule zero-bubble needs --pipeline-model-parallel-size > 1"),
    (tiny_config(pp=2, model={"num_layers": 6}, parallel={"pipeline_schedule": "zbv",
                                                          "num_virtual_stages_per_pipeline_rank": 3}), 2,
     "--pipeline-schedule zbv places exactly 2 chunks on each pipeline rank, got 3 virtual stages"),
    (tiny_config(pp=2, model={"num_layers": 4}, parallel={"pipeline_schedule": "zbv"}, optimizer={"zero_stage": 3}),
     4, "--pipeline-schedule zbv defers weight gradients to later steps, which FSDP2's per-layer gradient reduction "
        "(--zero-stage 3) does not wait for"),
    (tiny_config(training={"global_batch_size": 6}), 2,
     "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2 = 4"),
    (tiny_config(model={"hidden_size": 66}), 1, "--hidden-size 66 is not divisible by --num-attention-heads 4"),
    (tiny_config(model={"max_position_embeddings": 16}), 1,
     "--max-position-embeddings 16 is smaller than --seq-length 32"),
    (tiny_config(optimizer={"lr_decay_style": "exp"}), 1, "--lr-decay-style must be cosine, linear or constant"),
    (tiny_config(optimizer={"min_lr": 1.0}), 1, "need 0 <= --min-lr <= --lr"),
    (tiny_config(model={"hidden_dropout": 1.0}), 1, "--hidden-dropout must be in [0, 1)"),
    (tiny_config(training={"micro_batch_size": 0}), 1, "--micro-batch-size must be >= 1, got 0"),
    (tiny_config(data={"data_path": "a"}), 1, "--mock-data and --data-path exclude each other"),
    (tiny_config(data={"mock_data": False, "data_path": "a"}), 1, "--data-path needs --tokenizer-model"),
    (tiny_config(data={"mock_data": False, "tokenizer_model": "t.model"}), 1,
     "--tokenizer-type/--tokenizer-model/--vocab-file/--merge-file need --data-path"),
    (tiny_config(data={"mock_data": False, "data_path": "0.3 a 0.7", "tokenizer_model": "t"}), 1,
     "weights and prefixes must come in pairs"),
    (tiny_config(data={"mock_data": False, "data_path": "0.3 a x b", "tokenizer_model": "t"}), 1, "bad weight"),
    (tiny_config(data={"mock_data": False, "data_path": "0 a 0 b", "tokenizer_model": "t"}), 1,
     "weights must be >= 0 with a positive sum"),
    (tiny_config(data={"mock_data": False, "data_path": " ", "tokenizer_model": "t"}), 1, "--data-path is empty"),
    (tiny_config(data={"split": "90,10,0,1"}), 1, "--split '90,10,0,1' must be up to three proportions"),
    (tiny_config(data={"split": "a,b"}), 1, "--split 'a,b'"),
    (tiny_config(data={"tokenizer_type": "WordPiece"}), 1,
     "--tokenizer-type must be SentencePieceTokenizer, HuggingFaceTokenizer, GPT2BPETokenizer, NullTokenizer, "
     "GPTSentencePieceTokenizer, Llama2Tokenizer or TikTokenizer"),
    (tiny_config(data={"mock_data": False, "data_path": "a", "tokenizer_type": "HuggingFaceTokenizer"}), 1,
     "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model"),
    (tiny_config(data={"mock_data": False, "data_path": "a", "tokenizer_type": "GPT2BPETokenizer",
                       "vocab_file": "vocab.json"}), 1, "--tokenizer-type GPT2BPETokenizer needs --merge-file"),
    (tiny_config(data={"mock_data": False, "vocab_file": "vocab.json"}), 1,
     "/--vocab-file/--merge-file need --data-path"),
    (tiny_config(model={"use_rope_scaling": True}), 1, "--use-rope-scaling needs --position-embedding-type rope"),
    (tiny_config(model={"position_embedding_type": "rope", "use_rope_scaling": True, "rope_scaling_factor": 0.5}), 1,
     "--rope-scaling-factor must be >= 1, got 0.5"),
    (tiny_config(model={"position_embedding_type": "rope", "use_rope_scaling": True,
                        "rope_scaling_low_freq_factor": 4.0}), 1,
     "need 0 < --rope-scaling-low-freq-factor < --rope-scaling-high-freq-factor, got 4.0 and 4.0"),
    (tiny_config(model={"position_embedding_type": "rope", "rope_scaling_type": "yarn"}), 1,
     "--rope-scaling-type yarn needs --use-rope-scaling"),
    (tiny_config(model={"position_embedding_type": "rope", "use_rope_scaling": True, "rope_scaling_type": "dynamic"}), 1,
     "--rope-scaling-type dynamic is not supported: dynamic NTK scaling changes the frequencies"),
    (tiny_config(model={"position_embedding_type": "rope", "use_rope_scaling": True, "rope_scaling_type": "ntk"}), 1,
     "--rope-scaling-type must be llama3, linear or yarn, got 'ntk'"),
    (tiny_config(model={"position_embedding_type": "rope", "use_rope_scaling": True, "rope_scaling_type": "yarn", "beta_slow": 40.0}), 1,
     "need 0 < --beta-slow < --beta-fast, got 40.0 and 32.0"),
    (tiny_config(model={"position_embedding_type": "rope", "use_rope_scaling": True, "rope_scaling_type": "yarn", "mscale": 0.707}), 1,
     "--mscale 0.707 needs --mscale-all-dim"),
    (tiny_config(model={"position_embedding_type": "rope", "use_rope_scaling": True, "rope_scaling_type": "yarn", "mscale_all_dim": -1.0}), 1,
     "need --mscale > 0 and --mscale-all-dim >= 0, got 1.0 and -1.0"),
    (tiny_config(model={"position_embedding_type": "rope", "use_rope_scaling": True, "rope_scaling_type": "yarn", "rope_scaling_attention_factor": 0.0}), 1,
     "--rope-scaling-attention-factor must be > 0, got 0.0"),
    (tiny_config(model={"swiglu": True, "openai_gelu": True}), 1, "--openai-gelu is for the GeLU MLPs, not --swiglu"),
    (tiny_config(model={"swiglu": True, "quick_geglu": True}), 1,
     "--swiglu and --quick-geglu are 2 gated MLPs: give one"),
    (tiny_config(model={"glu_linear_offset": 1.0}), 1,
     "--glu-linear-offset is for a gated MLP (--swiglu, --quick-geglu or --gated-linear-unit)"),
    (tiny_config(model={"activation_func_clamp_value": 7.0}), 1,
     "--activation-func-clamp-value is for a gated MLP (--swiglu, --quick-geglu or "
     "--gated-linear-unit)"),
    (tiny_config(model={"quick_geglu": True, "activation_func_clamp_value": -1.0}), 1,
     "--activation-func-clamp-value must be > 0, got -1.0"),
    (tiny_config(model={"position_embedding_type": "rope", "yarn_unrounded_correction_range": True}), 1,
     "--yarn-unrounded-correction-range needs --use-rope-scaling with --rope-scaling-type yarn"),
    (tiny_config(data={"eval_iters": -1}), 1, "--eval-iters must be >= 0"),
    (tiny_config(tp=2, model={"hidden_size": 96, "num_attention_heads": 12, "group_query_attention": True,
                              "num_query_groups": 3}), 2,
     "--num-query-groups 3 is not divisible by --tensor-model-parallel-size 2, nor 2 by 3: one must divide the other; "
     "tensor-model-parallel sizes that work: 1, 3, 6, 12"),
    (tiny_config(tp=4, model={"num_attention_heads": 32, "group_query_attention": True}), 4,
     "with --num-query-groups 1 over --tensor-model-parallel-size 4, each key/value head is split over 4 ranks, which "
     "head dimension 2 does not allow; tensor-model-parallel sizes that work: 1, 2"),
    (tiny_config(model={"group_query_attention": True, "num_query_groups": 3}), 1,
     "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    (tiny_config(model={"hidden_size": 60, "position_embedding_type": "rope"}), 1,
     "rope needs an even head dimension, got --hidden-size 60 / --num-attention-heads 4 = 15"),
    (tiny_config(model={"position_embedding_type": "alibi"}), 1, "--position-embedding-type must be learned_absolute"),
    (tiny_config(model={"normalization": "rmsnorm"}), 1, "--normalization must be LayerNorm or RMSNorm"),
    (tiny_config(parallel={"sequence_parallel": True}), 1,
     "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (tiny_config(tp=4, model={"seq_length": 30}, parallel={"sequence_parallel": True}), 4,
     "with --sequence-parallel, --seq-length 30 must be divisible by --tensor-model-parallel-size 4"),
    (tiny_config(model={"recompute_granularity": "full"}), 1,
     "--recompute-granularity full needs --recompute-method uniform|block"),
    (tiny_config(model={"recompute_granularity": "selective", "recompute_method": "block"}), 1,
     "--recompute-method applies to --recompute-granularity full only"),
    (tiny_config(pp=2, model={"recompute_granularity": "full", "recompute_method": "block",
                              "recompute_num_layers": 2}), 2,
     "--recompute-num-layers must be between 1 and the 1 layers of the largest model chunk, got 2"),
    (tiny_config(model={"recompute_granularity": "some"}), 1, "--recompute-granularity must be full or selective"),
    (tiny_config(optimizer={"zero_stage": 4}), 1, "--zero-stage must be 1, 2 or 3, got 4"),
    (tiny_config(optimizer={"zero_stage": 2}), 2, "--zero-stage 2 needs --use-distributed-optimizer"),
    (tiny_config(optimizer={"zero_stage": 3, "use_distributed_optimizer": True}), 2,
     "--zero-stage 3 shards the optimizer itself (FSDP2): drop --use-distributed-optimizer"),
    (tiny_config(optimizer={"zero_stage": 3, "overlap_grad_reduce": True}), 2,
     "--overlap-grad-reduce is for stages 1-2"),
    (tiny_config(tp=2, optimizer={"zero_stage": 3}), 2,
     "--zero-stage 3 shards over data-parallel ranks and this layout has none (data-parallel size 1)"),
    (tiny_config(optimizer={"offload_params": True, "optimizer_cpu_offload": True}), 2,
     "--offload-params needs --zero-stage 3"),
    (tiny_config(optimizer={"zero_stage": 3, "offload_params": True}), 2,
     "--offload-params needs --optimizer-cpu-offload"),
    (tiny_config(optimizer={"zero3_prefetch_bucket_size": 10**6}), 2,
     "--zero3-prefetch-bucket-size needs --zero-stage 3"),
    (tiny_config(optimizer={"zero_stage": 3, "zero3_prefetch_bucket_size": 0}), 2,
     "--zero3-prefetch-bucket-size must be >= 1, got 0"),
    (tiny_config(tp=2, parallel={"context_parallel_size": 2}), 6,
     "world size 6 is not divisible by --tensor-model-parallel-size 2 x --context-parallel-size 2 x "
     "--pipeline-model-parallel-size 1 = 4"),
    (tiny_config(model={"seq_length": 36}, parallel={"context_parallel_size": 4}), 4,
     "--seq-length 36 is not divisible by 2 x --context-parallel-size 4 = 8 (with --cp-comm-type p2p each rank holds "
     "two chunks"),
    (tiny_config(model={"seq_length": 30}, parallel={"context_parallel_size": 4, "cp_comm_type": "a2a"}), 4,
     "--seq-length 30 is not divisible by --context-parallel-size 4"),
    (tiny_config(tp=2, parallel={"context_parallel_size": 4, "cp_comm_type": "a2a"}), 8,
     "--cp-comm-type a2a splits each tensor-parallel rank's 2 attention heads (--num-attention-heads 4 / "
     "--tensor-model-parallel-size 2) over --context-parallel-size 4, which does not divide them"),
    (tiny_config(parallel={"context_parallel_size": 2, "cp_comm_type": "ring"}), 2,
     "--cp-comm-type must be p2p, a2a, allgather or a2a+p2p, got 'ring'"),
    (tiny_config(model={"attention_dropout": 0.1}, parallel={"context_parallel_size": 2}), 2,
     "--cp-comm-type p2p computes attention blockwise without dropout: set --attention-dropout 0"),
    (tiny_config(tp=2, model={"seq_length": 34}, parallel={"context_parallel_size": 2, "cp_comm_type": "a2a",
                                                           "sequence_parallel": True}), 4,
     "with --sequence-parallel, --seq-length 34 must be divisible by --tensor-model-parallel-size 2 x "
     "--context-parallel-size 2"),
    (tiny_config(data={"reset_attention_mask": True, "eod_mask_loss": True}), 1,
     "--reset-attention-mask/--eod-mask-loss need documents, which --mock-data does not have"),
    (tiny_config(model={"fp8_format": "hybrid"}), 1,
     "--fp8-format needs --bf16: FP8 products take bf16 activations and master weights"),
    (tiny_config(model={"fp8_format": "e5m2"}), 1, "--fp8-format must be e4m3 or hybrid, got 'e5m2'"),
    (tiny_config(model={"fp8_format": "hybrid", "fp8_recipe": "blockwise"}, training={"bf16": True}), 1,
     "--fp8-recipe must be tensorwise, delayed or rowwise, got 'blockwise'"),
    (tiny_config(model={"fp8_amax_compute_algo": "mean"}), 1, "--fp8-amax-compute-algo must be max or most_recent"),
    (tiny_config(model={"fp8_amax_history_len": 0}), 1, "--fp8-amax-history-len must be >= 1, got 0"),
    (tiny_config(model={"fp8_format": "e4m3", "ffn_hidden_size": 200}, training={"bf16": True}), 1,
     "--fp8-format needs every dimension of the FP8 matrix products to be a multiple of 16: the MLP's first 200 "
     "outputs / TP 1 = 200 is not"),
    (tiny_config(tp=4, model={"fp8_format": "e4m3", "hidden_size": 96}, training={"bf16": True}), 4,
     "the query/key/value projection's 288 outputs / TP 4 = 72 is not"),
    (tiny_config(model={"fp8_format": "e4m3", "seq_length": 36}, training={"bf16": True}), 1,
     "--micro-batch-size 2 x --seq-length 36 tokens = 72 is not"),
    (tiny_config(model={"fp8_param_gather": True}), 1, "--fp8-param-gather needs --fp8-format"),
    (tiny_config(model={"fp8_format": "e4m3", "fp8_param_gather": True}, training={"bf16": True}), 2,
     "--fp8-param-gather needs --use-distributed-optimizer or --zero-stage 3: it is their parameter all-gather"),
    (tiny_config(model={"fp8_format": "e4m3", "fp8_recipe": "rowwise", "fp8_param_gather": True},
                 optimizer={"use_distributed_optimizer": True}, training={"bf16": True}), 2,
     "--fp8-param-gather needs --fp8-recipe tensorwise or delayed: rowwise scales a weight per row"),
    (tiny_config(model={"fp8_format": "e4m3", "fp8_param_gather": True}, optimizer={"zero_stage": 3},
                 training={"bf16": True}), 3,
     "--fp8-param-gather with --zero-stage 3 needs each FP8 weight's rows to split evenly over the 3 data-parallel "
     "ranks: the MLP's first 256 rows / TP 1 = 256 does not"),
    (tiny_config(model={"window_size": "4096"}), 1, "--window-size '4096' must be two integers LEFT,RIGHT, e.g. 4096,0"),
    (tiny_config(model={"window_size": "(8, 8)"}), 1,
     "--window-size '(8, 8)': attention is causal, so it takes LEFT >= 0 tokens before each query and RIGHT 0"),
    (tiny_config(model={"window_size": "-1,0"}), 1, "--window-size '-1,0': attention is causal"),
    (tiny_config(model={"window_attn_skip_freq": "2"}), 1, "--window-attn-skip-freq needs --window-size"),
    (tiny_config(model={"window_size": "8,0", "window_attn_skip_freq": "0"}), 1,
     "--window-attn-skip-freq must be >= 1, got 0"),
    (tiny_config(model={"window_size": "8,0", "window_attn_skip_freq": "[1,0,1]"}), 1,
     "--window-attn-skip-freq '[1,0,1]' has 3 entries for --num-layers 2"),
    (tiny_config(model={"window_size": "8,0", "window_attn_skip_freq": "[1,2]"}), 1,
     "--window-attn-skip-freq '[1,2]' must be an integer or a list of 0/1 (1: windowed)"),
    (tiny_config(model={"softmax_type": "sink"}), 1,
     "--softmax-type must be vanilla, off-by-one or learnable, got 'sink'"),
    (tiny_config(model={"softmax_type": "learnable"}, parallel={"context_parallel_size": 2}), 2,
     "--softmax-type learnable is not supported with --context-parallel-size 2 (the context-parallel attention has "
     "no sink)"),
    (tiny_config(model={"recompute_modules": "mlp"}), 1,
     "--recompute-modules applies to --recompute-granularity selective"),
    (tiny_config(model={"recompute_granularity": "selective", "recompute_modules": "core_attn mpl"}), 1,
     "--recompute-modules: unknown mpl (choose from core_attn, mlp, moe, shared_experts, layernorm, moe_act, "
     "mla_up_proj)"),
    (tiny_config(model={"recompute_granularity": "selective", "recompute_modules": "moe_act"}), 1,
     "--recompute-modules moe_act needs --num-experts: the model has no such part"),
    (tiny_config(model={"offload_modules": "core_attn"}), 1,
     "--offload-modules needs --fine-grained-activation-offloading"),
    (tiny_config(model={"fine_grained_activation_offloading": True, "offload_modules": "core_attn qkv_linear"}), 1,
     "--offload-modules: unknown qkv_linear (choose from attn_norm, core_attn, attn_proj, mlp_norm, expert_fc1, "
     "moe_act)"),
    (tiny_config(model={"fine_grained_activation_offloading": True, "offload_modules": "attn_proj"}), 1,
     "--offload-modules attn_proj needs core_attn: the attention core keeps the output projection's input too"),
    (tiny_config(model={"fine_grained_activation_offloading": True, "offload_modules": "moe_act"}), 1,
     "--offload-modules moe_act needs --num-experts: the model has no such part"),
    (tiny_config(model={"fine_grained_activation_offloading": True, "offload_modules": "attn_norm",
                        "recompute_granularity": "full", "recompute_method": "uniform"}), 1,
     "--fine-grained-activation-offloading does not apply to --recompute-granularity full: a recomputed layer keeps "
     "only its input, and its parts save what they keep while backward reruns them"),
    (tiny_config(optimizer={"optimizer": "sgd"}), 1, "--optimizer must be adam or muon, got 'sgd'"),
    (tiny_config(optimizer={"optimizer": "muon", "optimizer_cpu_offload": True}), 1,
     "--optimizer muon does not run with --optimizer-cpu-offload"),
    (tiny_config(optimizer={"muon_tp_mode": "gathered"}), 1,
     "--muon-tp-mode must be duplicated, distributed or blockwise, got 'gathered'"),
    (tiny_config(model={"mtp_num_layers": 1}), 1,
     "--mtp-num-layers needs --position-embedding-type rope or none (Megatron's rule: the multi-token prediction "
     "modules embed shifted tokens, and learned absolute positions are not supported)"),
    (tiny_config(model={"mtp_num_layers": 0, "position_embedding_type": "rope"}), 1,
     "--mtp-num-layers must be >= 1, got 0"),
    (tiny_config(model={"mtp_num_layers": 32, "position_embedding_type": "rope"}), 1,
     "--mtp-num-layers 32 leaves no token to predict in --seq-length 32"),
    (tiny_config(model={"mtp_loss_scaling_factor": -0.1}), 1, "--mtp-loss-scaling-factor must be >= 0, got -0.1"),
    (tiny_config(model={"swiglu": True, "gated_linear_unit": True}), 1,
     "--swiglu and --gated-linear-unit are 2 gated MLPs: give one"),
    (tiny_config(model={"gated_linear_unit": True, "num_experts": 4}), 1,
     "--gated-linear-unit is not supported with --num-experts (the experts are SwiGLU or GeLU MLPs)"),
    (tiny_config(model={"softmax_scale": 0.0}), 1, "--softmax-scale must be > 0, got 0.0"),
    (tiny_config(model={"local_rotary_base": 10000, "position_embedding_type": "rope"}), 1,
     "--local-rotary-base is the rotary base of the windowed layers: it needs --position-embedding-type rope and "
     "--window-size"),
    (tiny_config(model={"local_rotary_base": 0, "position_embedding_type": "rope", "window_size": "8,0"}), 1,
     "--local-rotary-base must be >= 1, got 0"),
    (tiny_config(parallel={"num_distributed_optimizer_instances": 3}, optimizer={"use_distributed_optimizer": True}),
     4, "--num-distributed-optimizer-instances 3 does not divide the data-parallel x context-parallel size 4"),
    (tiny_config(parallel={"num_distributed_optimizer_instances": 0}), 4,
     "--num-distributed-optimizer-instances 0 does not divide the data-parallel x context-parallel size 4"),
    (tiny_config(parallel={"num_distributed_optimizer_instances": 2}), 4,
     "--num-distributed-optimizer-instances 2 needs --use-distributed-optimizer or --zero-stage 3: the instances "
     "shard optimizer states, which plain data parallelism does not"),
    (tiny_config(parallel={"num_distributed_optimizer_instances": 2}, optimizer={"zero_stage": 3}), 2,
     "--num-distributed-optimizer-instances 2 with --zero-stage 3 leaves one rank per instance"),
    (tiny_config(parallel={"num_distributed_optimizer_instances": 2}, optimizer={"use_distributed_optimizer": True},
                 model={"num_experts": 4}), 4,
     "--num-distributed-optimizer-instances 2 does not split the expert-data-parallel group into instances yet"),
    (tiny_config(parallel={"num_distributed_optimizer_instances": 2}, optimizer={"zero_stage": 3,
                                                                                  "optimizer": "muon"}), 4,
     "--num-distributed-optimizer-instances 2 with --zero-stage 3 does not run with --optimizer muon yet"),
])
def test_bad_values_name_the_numbers(cfg, world, message):
    with pytest.raises(ConfigError) as error:
        validate(cfg, world)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_hsdp_layouts_are_valid():
    """HSDP with ZeRO-1, 2 and 3, beside TP, PP and CP; N = 1 with plain data parallelism (the default)."""
    for zero, tp, pp, cp, world in [(1, 1, 1, 1, 4), (2, 2, 1, 1, 8), (3, 1, 2, 1, 8), (1, 1, 1, 2, 4)]:
        validate(tiny_config(tp=tp, pp=pp, parallel={"num_distributed_optimizer_instances": 2,
                                                     "context_parallel_size": cp},
                             optimizer=OptimizerConfig.zero_settings(zero)), world)


def test_context_parallel_layouts():
    for world, tp, pp, cp, kind in [(2, 1, 1, 2, "p2p"), (4, 1, 1, 4, "a2a"), (4, 2, 1, 2, "allgather"),
                                    (8, 1, 2, 2, "p2p"), (8, 2, 2, 2, "a2a")]:
        validate(tiny_config(tp=tp, pp=pp, model={"num_layers": 4},
                             parallel={"context_parallel_size": cp, "cp_comm_type": kind,
                                       "sequence_parallel": tp > 1}), world)
    # ZeRO-3 shards over DP x CP: CP alone gives it ranks to shard over.
    validate(tiny_config(optimizer={"zero_stage": 3}, parallel={"context_parallel_size": 2}), 2)
def test_zbv_has_two_chunks_and_any_number_of_micro_batches():
    cfg = tiny_config(pp=2, model={"num_layers": 4}, parallel={"pipeline_schedule": "zbv"},
                      training={"global_batch_size": 6})   # 3 micro-batches: no multiple of PP needed
    assert cfg.parallel.virtual_stages(4) == 2
    validate(cfg, 2)


def test_virtual_stages_from_either_option():
    assert tiny_config(pp=2, parallel={"num_layers_per_virtual_pipeline_stage": 1}).parallel.virtual_stages(8) == 4
    assert tiny_config(pp=2, parallel={"num_virtual_stages_per_pipeline_rank": 2}).parallel.virtual_stages(8) == 2
    assert tiny_config(pp=2).parallel.virtual_stages(8) == 1


def test_vocabulary_padding_is_a_multiple_of_divisor_times_tp():
    model = tiny_config().model   # vocab 301, divisor 128
    assert model.padded_vocab_size(1) == 384
    assert model.padded_vocab_size(2) == 512
    assert model.padded_vocab_size(4) == 512
    assert model.padded_vocab_size(8) == 1024


def test_data_options():
    validate(tiny_config(data={"mock_data": False}), 1)   # no data options at all: the built-in corpus
    validate(tiny_config(data={"mock_data": False, "data_path": "a b", "tokenizer_model": "t.model"}), 1)
    validate(tiny_config(data={"mock_data": False, "data_path": "a", "tokenizer_type": "NullTokenizer"}), 1)
    validate(tiny_config(data={"mock_data": False, "data_path": "a", "tokenizer_type": "GPT2BPETokenizer",
                               "vocab_file": "v.json", "merge_file": "m.txt"}), 1)
    # No tokenizer option with --load: the checkpoint's tokenizer (megalite.checkpoint.with_checkpoint_tokenizer).
    validate(tiny_config(data={"mock_data": False, "data_path": "a"}, checkpoint={"load": "ckpt"}), 1)
    data = tiny_config(data={"data_path": "0.3 a 0.7 b", "split": "99,1"}).data
    assert data.blend() == (["a", "b"], [0.3, 0.7]) and data.split_fractions() == [0.99, 0.01, 0.0]
    assert tiny_config(data={"data_path": "a  b"}).data.blend() == (["a", "b"], None)
    assert tiny_config(data={"split": "8/1/1"}).data.split_fractions() == [0.8, 0.1, 0.1]


def test_architecture_and_memory_options_combine_with_parallel_layouts():
    llama = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
             "group_query_attention": True, "num_query_groups": 2, "disable_bias_linear": True}
    for tp, groups in [(1, 2), (2, 2), (4, 2), (4, 1), (2, 4)]:   # G % TP == 0 and TP % G == 0 both work
        validate(tiny_config(tp=tp, model={**llama, "num_query_groups": groups},
                             parallel={"sequence_parallel": tp > 1}), tp * 2)
    validate(tiny_config(tp=2, pp=2, model={"num_layers": 4, "recompute_granularity": "full",
                                            "recompute_method": "uniform", "recompute_num_layers": 2}), 4)
    validate(tiny_config(model={"recompute_granularity": "selective"}), 1)
    # Megatron's spellings of a window and its skip pattern (layers counted from 1; 1 windowed, 0 global).
    for window, skip, windows in [("4,0", None, [4, 4]), ("(4, 0)", "2", [4, None]), ("4,0", "[0,1]", [None, 4]),
                                  ("0,0", "([1]*2)", [0, 0])]:
        model = tiny_config(model={"window_size": window, "window_attn_skip_freq": skip}).model
        assert model.attention_windows() == windows
    validate(tiny_config(tp=2, pp=2, model={"window_size": "4,0", "window_attn_skip_freq": "2"}), 4)


@pytest.mark.parametrize("section, field, flag", [
    ("optimizer", "lr", "--lr"), ("model", "init_method_std", "--init-method-std"),
    ("model", "layernorm_epsilon", "--layernorm-epsilon"), ("optimizer", "weight_decay", "--weight-decay"),
    ("optimizer", "initial_loss_scale", "--initial-loss-scale"), ("training", "exit_duration_in_mins",
                                                                    "--exit-duration-in-mins")])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), float("-inf")])
def test_a_float_option_that_is_not_finite_is_refused_naming_its_flag(section, field, flag, value):
    with pytest.raises(ConfigError) as refused:
        validate(tiny_config(**{section: {field: value}}), 1)
    assert str(refused.value) == f"{flag} must be a finite number, got {value}"


def test_every_float_option_is_checked_for_finiteness():
    """Generic over the schema: each float field of every section, set to inf, is refused by its own flag."""
    import dataclasses
    import typing

    from megalite.config.flags import FLAG
    from megalite.config.schema import sections

    checked = 0
    for section, cls in sections():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if hints[field.name] in (float, typing.Optional[float]):
                cfg = tiny_config()
                setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **{field.name: float("inf")}))
                with pytest.raises(ConfigError, match=f"^{getattr(FLAG, field.name)} must be a finite number"):
                    validate(cfg, 1)
                checked += 1
    assert checked >= 25


@pytest.mark.parametrize("optimizer, message", [
    ({"adam_eps": 0.0}, "--adam-eps must be > 0, got 0.0"),
    ({"weight_decay": -0.1}, "--weight-decay must be >= 0, got -0.1"),
    ({"lr": -1e-3}, "need 0 <= --min-lr <= --lr"),
])
def test_optimizer_values_that_poison_the_weights_are_refused(optimizer, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        validate(tiny_config(optimizer=optimizer), 1)


@pytest.mark.parametrize("model, message", [
    ({"init_method_std": -0.02}, "--init-method-std must be >= 0, got -0.02"),
    ({"layernorm_epsilon": -1e-5}, "--layernorm-epsilon must be >= 0, got -1e-05"),
])
def test_negative_init_std_or_epsilon_is_refused(model, message):
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(model=model), 1)


@pytest.mark.parametrize("words, message", [
    (["--fp16", "--initial-loss-scale", "inf"], "--initial-loss-scale must be a finite number, got inf"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--layernorm-epsilon", "nan"], "--layernorm-epsilon must be a finite number, got nan"),
    (["--adam-eps", "0"], "--adam-eps must be > 0, got 0.0"),
])
def test_pretrain_gpt_refuses_a_poisoning_flag_in_one_line(words, message, capsys):
    import pretrain_gpt

    from ..helpers import TINY

    assert pretrain_gpt.main([*TINY, *words]) == 2
    assert capsys.readouterr().err.splitlines() == [f"megalite: error: {message}"]
