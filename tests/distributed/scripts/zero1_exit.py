"""Two-rank zero1 training that then simply exits: used by tests/distributed/test_exit.py (run under torchrun)."""
import torch

import atorch
from atorch.auto import auto_accelerate
from atorch.models import GPT, GPTConfig, SyntheticTokenDataset, gpt_loss

atorch.init_distributed()
cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
torch.manual_seed(0)
status, result, _ = auto_accelerate(GPT(cfg), torch.optim.AdamW, SyntheticTokenDataset(64, 16, 64), gpt_loss,
                                    optim_args={"lr": 1e-3}, dataloader_args={"batch_size": 8},
                                    model_input_format="unpack_dict", load_strategy=["zero1"])
for step, batch in enumerate(result.dataloader):
    batch = result.prepare_input(batch)
    loss = result.loss_func(batch, result.model(**batch))
    result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
    result.optim.step()
    result.optim.zero_grad()
    if step == 3:
        break
