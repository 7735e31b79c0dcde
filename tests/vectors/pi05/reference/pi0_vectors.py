"""Reference vector for rlvla3's pi0: a tiny folder written by LeRobot 0.6.1's PI0Policy.save_pretrained
(every tensor re-drawn), its actions from raw inputs with fixed noise, and PI0Pytorch.forward's
flow-matching loss on fixed actions / noise / times. Run with /work/ref/lerobot/bin/python."""
import json, os, sys
import numpy as np
import torch
sys.path.insert(0, os.path.dirname(__file__))
from pi05_common import SEED, char_tokenizer, make_tiny, redraw

OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
make_tiny()
from lerobot.configs.types import FeatureType, PolicyFeature
from lerobot.policies.pi0.configuration_pi0 import PI0Config
from lerobot.policies.pi0.modeling_pi0 import PI0Policy
from lerobot.policies.pi0 import processor_pi0
from lerobot.processor import PolicyProcessorPipeline
from lerobot.processor.converters import policy_action_to_transition, transition_to_policy_action
from safetensors.torch import load_file

TOK = char_tokenizer()
_TS = processor_pi0.TokenizerProcessorStep
processor_pi0.TokenizerProcessorStep = lambda **kw: _TS(tokenizer=TOK, **kw)
CAMS = {"front": (48, 64), "wrist": (40, 40)}
SD, AD, CHUNK, STEPS = 8, 7, 5, 4
feats_in = {f"observation.images.{c}": PolicyFeature(type=FeatureType.VISUAL, shape=(3, h, w)) for c, (h, w) in CAMS.items()}
feats_in["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(SD,))
feats_out = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(AD,))}
cfg = PI0Config(input_features=feats_in, output_features=feats_out, device="cpu", chunk_size=CHUNK, n_action_steps=CHUNK,
                num_inference_steps=STEPS, image_resolution=(32, 32))
rng = np.random.default_rng(11)
stats = {"observation.state": {"mean": rng.uniform(-0.5, 0.5, SD), "std": rng.uniform(0.5, 2.0, SD)},
         "action": {"mean": rng.uniform(-0.3, 0.3, AD), "std": rng.uniform(0.2, 1.5, AD)}}
stats = {f: {k: torch.tensor(v, dtype=torch.float32) for k, v in d.items()} for f, d in stats.items()}
policy = PI0Policy(cfg)
folder = os.path.join(OUT, "folder_pi0")
policy.save_pretrained(folder)
shapes = {k: list(v.shape) for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
drawn = redraw(shapes, SEED + 100)
assert policy.load_state_dict(drawn, strict=False).unexpected_keys == []
policy.save_pretrained(folder)
pre, post = processor_pi0.make_pi0_pre_post_processors(cfg, dataset_stats=stats)
pre.save_pretrained(folder); post.save_pretrained(folder)
policy = PI0Policy.from_pretrained(folder); policy.eval()
assert all(torch.equal(policy.state_dict()[k], v) for k, v in drawn.items())
pre = PolicyProcessorPipeline.from_pretrained(folder, "policy_preprocessor.json", overrides={"tokenizer_processor": {"tokenizer": TOK}})
post = PolicyProcessorPipeline.from_pretrained(folder, "policy_postprocessor.json", to_transition=policy_action_to_transition, to_output=transition_to_policy_action)
B = 2
images = {c: rng.integers(0, 256, (B, h, w, 3), dtype=np.uint8) for c, (h, w) in CAMS.items()}
state = rng.normal(0, 1, (B, SD)).astype(np.float32)
tasks = ["pick up the red block", "open the drawer"]
batch = {f"observation.images.{c}": torch.from_numpy(im).permute(0, 3, 1, 2).float() / 255.0 for c, im in images.items()}
batch["observation.state"] = torch.from_numpy(state); batch["task"] = tasks
proc = pre(batch)
g = torch.Generator().manual_seed(SEED + 101)
noise = torch.randn(B, CHUNK, 32, generator=g)
with torch.no_grad():
    actions = post(policy.predict_action_chunk(proc, noise=noise.clone()))
    raw_act = torch.from_numpy(rng.uniform(-1, 1, (B, CHUNK, AD)).astype(np.float32))
    lb = pre({**batch, "action": raw_act})
    imgs, img_masks = policy._preprocess_images(lb)
    fm_noise = torch.randn(B, CHUNK, 32, generator=g); fm_time = torch.tensor([0.3, 0.85])
    losses = policy.model.forward(imgs, img_masks, lb["observation.language.tokens"], lb["observation.language.attention_mask"],
                                  policy.prepare_state(lb), policy.prepare_action(lb), fm_noise, fm_time)
    loss = losses[:, :, :AD].mean()
vec = {"how": f"reference/pi0_vectors.py: LeRobot 0.6.1 PI0Policy at the pi0.5 vector's tiny size, redraw(seed={SEED + 100})",
       "seed": SEED + 100, "shapes": shapes, "config": json.load(open(os.path.join(folder, "config.json"))),
       "preprocessor": json.load(open(os.path.join(folder, "policy_preprocessor.json"))),
       "postprocessor": json.load(open(os.path.join(folder, "policy_postprocessor.json"))),
       "stats": {f: {k: v.tolist() for k, v in d.items()} for f, d in stats.items()},
       "images": {c: im.tolist() for c, im in images.items()}, "state": state.tolist(), "tasks": tasks,
       "noise": noise.tolist(), "actions": actions.tolist(),
       "loss": {"actions": raw_act.tolist(), "noise": fm_noise.tolist(), "time": fm_time.tolist(), "loss": float(loss)}}
json.dump(vec, open(os.path.join(OUT, "pi0_lerobot_tiny.json"), "w"))
print("loss", float(loss), sorted(os.listdir(folder)))
