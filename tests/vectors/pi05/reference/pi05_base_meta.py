"""lerobot/pi05_base's tensor list: LeRobot 0.6.1's PI05Policy built from the default PI05Config
(the pi05_base config: gemma_2b + gemma_300m, 224 px, 32-d) on the meta device."""
import json, sys
import torch
from lerobot.policies.pi05.configuration_pi05 import PI05Config
from lerobot.policies.pi05.modeling_pi05 import PI05Policy
cfg = PI05Config(device="cpu")
cfg.device = "meta"
with torch.device("meta"):
    p = PI05Policy(cfg)
sd = p.state_dict()
out = {k: list(v.shape) for k, v in sd.items()}
json.dump({"how": "LeRobot 0.6.1 PI05Policy(PI05Config(device='cpu')) on torch.device('meta'); state_dict() names and shapes "
                  "(what save_pretrained writes)", "dtype": str(next(iter(sd.values())).dtype), "tensors": out},
          open(sys.argv[1], "w"), indent=0, sort_keys=True)
print(len(out), sum(torch.Size(s).numel() for s in out.values()))
