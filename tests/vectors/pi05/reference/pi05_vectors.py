"""Reference vectors for rlvla3's pi0.5: a tiny folder written by LeRobot 0.6.1's own save_pretrained
(every tensor re-drawn), LeRobot's actions from raw inputs with fixed noise, RLinf's flow-SDE
log-prob of the chain, and the flow-matching loss. Run with /work/ref/lerobot/bin/python."""
import ast, json, os, subprocess, sys
import numpy as np
import torch
sys.path.insert(0, os.path.dirname(__file__))
from pi05_common import SEED, char_tokenizer, make_tiny, redraw

OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
make_tiny()
from lerobot.configs.types import FeatureType, PolicyFeature, NormalizationMode
from lerobot.policies.pi05.configuration_pi05 import PI05Config
from lerobot.policies.pi05.modeling_pi05 import PI05Policy
from lerobot.policies.pi05 import processor_pi05
from safetensors.torch import load_file, save_file

TOK = char_tokenizer()
_TS = processor_pi05.TokenizerProcessorStep
processor_pi05.TokenizerProcessorStep = lambda **kw: _TS(tokenizer=TOK, **kw)

CAMS = {"front": (48, 64), "wrist": (40, 40)}
SD, AD, CHUNK, STEPS = 8, 7, 5, 4
feats_in = {f"observation.images.{c}": PolicyFeature(type=FeatureType.VISUAL, shape=(3, h, w)) for c, (h, w) in CAMS.items()}
feats_in["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(SD,))
feats_out = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(AD,))}
cfg = PI05Config(input_features=feats_in, output_features=feats_out, device="cpu", chunk_size=CHUNK, n_action_steps=CHUNK,
                 num_inference_steps=STEPS, image_resolution=(32, 32), tokenizer_max_length=96)
rng = np.random.default_rng(7)
q01s, q99s = -1.5 + rng.uniform(0, 0.5, SD), 1.0 + rng.uniform(0, 1.0, SD)
q01a, q99a = -0.8 + rng.uniform(0, 0.3, AD), 0.6 + rng.uniform(0, 0.6, AD)
stats = {"observation.state": {"q01": q01s, "q99": q99s, "mean": (q01s + q99s) / 2, "std": (q99s - q01s) / 4,
                               "min": q01s - 0.1, "max": q99s + 0.1},
         "action": {"q01": q01a, "q99": q99a, "mean": (q01a + q99a) / 2, "std": (q99a - q01a) / 4, "min": q01a - 0.1, "max": q99a + 0.1}}
stats = {f: {k: torch.tensor(v, dtype=torch.float32) for k, v in d.items()} for f, d in stats.items()}

policy = PI05Policy(cfg)
folder = os.path.join(OUT, "folder")
policy.save_pretrained(folder)
saved = load_file(os.path.join(folder, "model.safetensors"))
shapes = {k: list(v.shape) for k, v in saved.items()}
drawn = redraw(shapes)
sd = policy.state_dict()
new = {}
for k, v in drawn.items():
    new[k] = v
tied = {k: v for k, v in sd.items() if k not in drawn}
print("not in saved file (tied / derived):", list(tied))
missing, unexpected = policy.load_state_dict(new, strict=False)
print("missing", missing, "unexpected", unexpected)
policy.save_pretrained(folder)
again = load_file(os.path.join(folder, "model.safetensors"))
assert set(again) == set(drawn) and all(torch.equal(again[k], drawn[k]) for k in drawn)
pre, post = processor_pi05.make_pi05_pre_post_processors(cfg, dataset_stats=stats)
pre.save_pretrained(folder)
post.save_pretrained(folder)
# reload exactly as a user would
policy = PI05Policy.from_pretrained(folder)
policy.eval()
sd_after = policy.state_dict()
for k in drawn:
    assert torch.equal(sd_after[k], drawn[k]), k
from lerobot.processor import PolicyProcessorPipeline
pre = PolicyProcessorPipeline.from_pretrained(folder, "policy_preprocessor.json", overrides={"tokenizer_processor": {"tokenizer": TOK}})
from lerobot.processor.converters import policy_action_to_transition, transition_to_policy_action
post = PolicyProcessorPipeline.from_pretrained(folder, "policy_postprocessor.json", to_transition=policy_action_to_transition, to_output=transition_to_policy_action)

B = 2
images = {c: rng.integers(0, 256, (B, h, w, 3), dtype=np.uint8) for c, (h, w) in CAMS.items()}
state = rng.uniform(-1.2, 1.8, (B, SD)).astype(np.float32)
tasks = ["Pick_up the Red\nblock", "  open the drawer_top "]
batch = {f"observation.images.{c}": torch.from_numpy(im).permute(0, 3, 1, 2).float() / 255.0 for c, im in images.items()}
batch["observation.state"] = torch.from_numpy(state)
batch["task"] = tasks
proc = pre(batch)
tokens = proc["observation.language.tokens"]; tmask = proc["observation.language.attention_mask"]
g = torch.Generator().manual_seed(SEED + 1)
noise = torch.randn(B, CHUNK, 32, generator=g)
with torch.no_grad():
    raw_actions = policy.predict_action_chunk(proc, noise=noise.clone())
actions = post(raw_actions)
print("actions", actions.shape)

# RLinf's flow-SDE: their own functions (source read from the RLinf mirror), on LeRobot's velocity
src = subprocess.run(["git", "-C", "/work/.mirror/RLinf+RLinf/repo", "show", "HEAD:rlinf/models/embodiment/openpi/openpi_action_model.py"],
                     capture_output=True, text=True, check=True).stdout
rlinf_rev = subprocess.run(["git", "-C", "/work/.mirror/RLinf+RLinf/repo", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
tree = ast.parse(src)
cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and any(isinstance(m, ast.FunctionDef) and m.name == "sample_mean_var_val" for m in n.body))
fns = {m.name: m for m in cls.body if isinstance(m, ast.FunctionDef) and m.name in ("_get_timesteps", "sample_mean_var_val", "get_logprob_norm")}
ns = {"torch": torch, "math": __import__("math")}
mod = ast.Module(body=list(fns.values()), type_ignores=[])
exec(compile(mod, "rlinf_openpi_action_model", "exec"), ns)
NOISE_LEVEL, STEP_IDX = 0.5, 1
class Shim:
    class config:
        add_value_head = False; value_after_vlm = True; safe_get_logprob = False
    _get_timesteps = ns["_get_timesteps"]; sample_mean_var_val = ns["sample_mean_var_val"]; get_logprob_norm = ns["get_logprob_norm"]
    def _get_noise_level(self, device, dtype):
        return torch.tensor(NOISE_LEVEL, device=device, dtype=dtype)
from lerobot.policies.common.vla_utils import make_att_2d_masks, prepare_attention_masks_4d
m = policy.model
imgs, img_masks = policy._preprocess_images(proc)
with torch.no_grad():
    pe, ppm, pam = m.embed_prefix(imgs, img_masks, tokens, tmask)
    p4 = prepare_attention_masks_4d(make_att_2d_masks(ppm, pam))
    m.paligemma_with_expert.paligemma.model.language_model.config._attn_implementation = "eager"
    _, pkv = m.paligemma_with_expert.forward(attention_mask=p4, position_ids=torch.cumsum(ppm, 1) - 1, past_key_values=None,
                                             inputs_embeds=[pe, None], use_cache=True)
    shim = Shim()
    shim.get_velocity = lambda state, x_t, t, pm, kv: (m.denoise_step(pm, kv, x_t, t), None)
    step_noise = torch.randn(STEPS, B, CHUNK, 32, generator=g)
    x = noise.clone(); chain = [x]; lps = []
    for idx in range(STEPS):
        method = "flow_sde" if idx == STEP_IDX else "flow_ode"
        mean, std, _, _ = shim.sample_mean_var_val(x, idx, torch.zeros(B, SD), ppm, pkv, method, STEPS, False)
        x = mean + step_noise[idx] * std
        lps.append(shim.get_logprob_norm(x, mean, std))
        chain.append(x)
    chain = torch.stack(chain, 1)
    lp = lps[STEP_IDX][:, :CHUNK, :AD]  # RLinf's per-element log-prob at the chosen step (action_chunk, action_env_dim)
    # flow-matching loss (PI05Pytorch.forward) on fixed actions / noise / times
    raw_act = torch.from_numpy(rng.uniform(-1, 1, (B, CHUNK, AD)).astype(np.float32))
    lb = pre({**batch, "action": raw_act})
    act_n = policy.prepare_action(lb)
    fm_noise = torch.randn(B, CHUNK, 32, generator=g)
    fm_time = torch.tensor([0.3, 0.85])
    losses = m.forward(imgs, img_masks, tokens, tmask, act_n, fm_noise, fm_time)
    loss = losses[:, :, :AD].mean()

vec = {
    "how": "scripts in the pi05 report; LeRobot 0.6.1 (Python 3.11, torch 2.13 CPU, transformers 5.5.4) PI05Policy at tiny size "
           "(variants' widths patched: VLM 64/3 layers, expert 32/3 layers, SigLIP 32/3 layers, vocab 128), every saved tensor "
           f"re-drawn by redraw(seed={SEED}); RLinf {rlinf_rev} _get_timesteps/sample_mean_var_val/get_logprob_norm run as-is",
    "seed": SEED, "shapes": shapes, "config": json.load(open(os.path.join(folder, "config.json"))),
    "preprocessor": json.load(open(os.path.join(folder, "policy_preprocessor.json"))),
    "postprocessor": json.load(open(os.path.join(folder, "policy_postprocessor.json"))),
    "stats": {f: {k: v.tolist() for k, v in d.items()} for f, d in stats.items()},
    "images": {c: im.tolist() for c, im in images.items()}, "state": state.tolist(), "tasks": tasks,
    "tokens": [t[mk.bool()].tolist() for t, mk in zip(tokens, tmask)],
    "noise": noise.tolist(), "actions": actions.tolist(),
    "sde": {"noise_level": NOISE_LEVEL, "step_index": STEP_IDX, "num_steps": STEPS, "chain": chain.tolist(),
            "logprob_sum": lp.sum(-1).tolist()},
    "loss": {"actions": raw_act.tolist(), "noise": fm_noise.tolist(), "time": fm_time.tolist(), "loss": float(loss)},
}
for f in os.listdir(folder):
    print("folder file", f)
json.dump(vec, open(os.path.join(OUT, "pi05_lerobot_tiny.json"), "w"))
print("loss", float(loss), "lp", lp.sum(-1)[:, :3])
