"""LeRobot 0.6.1 loads an rlvla3 pi0.5 export (tiny sizes as pi05_common) and acts on the vector's inputs."""
import json, os, sys
import numpy as np, torch
sys.path.insert(0, os.path.dirname(__file__))
from pi05_common import char_tokenizer, make_tiny
make_tiny()
from lerobot.policies.pi05.modeling_pi05 import PI05Policy
from lerobot.processor import PolicyProcessorPipeline
from lerobot.processor.converters import policy_action_to_transition, transition_to_policy_action
folder, vec = sys.argv[1], json.load(open(sys.argv[2]))
TOK = char_tokenizer()
policy = PI05Policy.from_pretrained(folder); policy.eval()
pre = PolicyProcessorPipeline.from_pretrained(folder, "policy_preprocessor.json", overrides={"tokenizer_processor": {"tokenizer": TOK}})
post = PolicyProcessorPipeline.from_pretrained(folder, "policy_postprocessor.json", to_transition=policy_action_to_transition, to_output=transition_to_policy_action)
batch = {f"observation.images.{c}": torch.tensor(np.array(im, dtype=np.uint8)).permute(0, 3, 1, 2).float() / 255.0 for c, im in vec["images"].items()}
batch["observation.state"] = torch.tensor(vec["state"]); batch["task"] = vec["tasks"]
with torch.no_grad():
    a = post(policy.predict_action_chunk(pre(batch), noise=torch.tensor(vec["noise"])))
print("LeRobot on the rlvla3 export vs the vector's LeRobot actions: max abs diff", (a - torch.tensor(vec["actions"])).abs().max().item())
