"""Parameter, gradient and optimizer bytes are exact for real tiny Llama and GPT-2 models."""

import pytest
import torch

import tracer
from costmodel.memory import estimate_memory, model_state_bytes, stage_params
from costmodel.profiles import load_device
from costmodel.strategy import TrainingConfig

SEQ = 32


def tiny(name):
    from transformers import GPT2Config, LlamaConfig

    if name == "llama":
        return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    return GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)


def real_model(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_traced_parameters_give_exact_state_bytes(name):
    config = tiny(name)
    graph = tracer.trace(config, batch=1, seq_len=SEQ)
    model = real_model(config)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)  # tied weights counted once
    params = stage_params(graph.ops, block_counts={b.id: b.count for b in graph.blocks})
    assert params.trainable == numel

    # autocast copies what matmuls read (Linear / GPT-2's Conv1D weights and biases, a tied embedding through the
    # LM head), not an untied embedding, position embeddings or norms
    from transformers.pytorch_utils import Conv1D

    matmul_read = {id(p): p.numel() for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D))
                   for p in m.parameters(recurse=False)}
    assert params.autocast_copied == sum(matmul_read.values()) < numel

    train = TrainingConfig(global_batch=1, seq_len=SEQ, precision="bf16", optimizer="adamw")
    est = estimate_memory(graph, device=load_device("h100-sxm"), train=train)
    assert est.grads == 4 * numel and est.optimizer == 8 * numel
    # fp32 masters, 16-bit copies of what autocast copies, frozen float buffers (rotary inv_freq) at 16 bit
    assert est.weights == 4 * numel + 2 * params.autocast_copied + 2 * params.frozen


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_predicted_state_matches_the_tensors_torch_allocates(optimizer):
    model = real_model(tiny("gpt2"))
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, 128, (1, SEQ))
    model(input_ids=ids, labels=ids).loss.backward()
    opt = torch.optim.AdamW(params) if optimizer == "adamw" else torch.optim.SGD(params, lr=0.1, momentum=0.9)
    opt.step()
    numel = sum(p.numel() for p in params)
    predicted = model_state_bytes(numel, precision="fp32", optimizer=optimizer, zero=0, dp_shard=1,
                                  offload_optimizer=False)
    assert predicted.weights == sum(p.numel() * p.element_size() for p in params)
    assert predicted.grads == sum(p.grad.numel() * p.grad.element_size() for p in params)
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items()
                if torch.is_tensor(v) and k != "step")
    assert predicted.optimizer == state
