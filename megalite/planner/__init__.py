"""Choosing the parallelism: parameter, memory, communication and throughput models, a layout search, and an
out-of-memory doctor.

    from megalite.planner import Hardware, load_model_config, plan
    result = plan(load_model_config("llama2_70b"), Hardware(num_gpus=64), global_batch_size=1024)
    print(format_plan(result))            # or to_json(result)

Modules, each one idea: ``parameters`` (exact counts per rank), ``memory`` (model states and activations per GPU),
``performance`` (FLOPs, communication, step time), ``layout`` (one candidate), ``hardware`` (GPUs and links),
``search`` (candidates, ranking, the reasons), ``report`` (text, JSON, the command line), ``doctor`` (what an
out-of-memory error means), ``models`` (configs/model files). ``tools/plan_parallelism.py`` is the command line.
"""

from megalite.planner.doctor import diagnose_out_of_memory, is_out_of_memory
from megalite.planner.hardware import Hardware
from megalite.planner.layout import Layout
from megalite.planner.memory import (ModelStates, Numerics, StageMemory, activation_bytes, bytes_per_parameter,
                                     memory_per_stage, model_state_bytes, stage_memory)
from megalite.planner.models import load_model_config, model_names
from megalite.planner.parameters import ParameterCount, count_parameters
from megalite.model.flops import model_flops_per_iteration
from megalite.planner.performance import step_time
from megalite.planner.report import command_line, format_plan, to_json
from megalite.planner.search import Estimate, Plan, estimate, search

plan = search

__all__ = ["Estimate", "Hardware", "Layout", "ModelStates", "Numerics", "ParameterCount", "Plan", "StageMemory",
           "activation_bytes", "bytes_per_parameter", "command_line", "count_parameters", "diagnose_out_of_memory",
           "estimate", "format_plan", "is_out_of_memory", "load_model_config", "memory_per_stage",
           "model_flops_per_iteration", "model_names", "model_state_bytes", "plan", "search", "stage_memory",
           "step_time", "to_json"]
