"""Pictures of one drafting round, like the paper's Figs. 8-11: DARTree's tree beside
DDTree's for the same round, tokens as text, each node shaded by its path probability, the
path the target accepted highlighted (SVG: `vllm_dartree.tree.render.render_svg`).

    python -m vllm_dartree.reference.picture --smollm2 --prompt "What is a prime number?" \\
        --out tree.svg [--after 8] [--budget 32] [--width 12] [--topk 64]
    python -m vllm_dartree.reference.picture --target DIR --drafter DIR --prompt TEXT --out FILE

The target (Hugging Face transformers) reads the chat-formatted prompt and decodes `--after`
tokens greedily; the drafter then drafts one round from there, each method builds its tree
from the same drafter output, and the target verifies each tree (greedy walk) in one pass
with its ancestor mask.
"""

from __future__ import annotations

import argparse

import torch

from vllm_dartree.tree.render import Panel, render_svg

__all__ = ["draft_round", "main"]


@torch.no_grad()
def draft_round(target, drafter, prompt_ids: list[int], configs: dict, after: int = 0):
    """Decode `after` tokens greedily, draft one round, build a tree per config and verify
    each with the target. Returns (context ids, root token, {name: (tree, accepted nodes,
    the target's greedy tokens along the tree)})."""
    from vllm_dartree.reference.decoder import DrafterSession, _features
    from vllm_dartree.tree import build_tree, greedy_walk
    from vllm_dartree.tree.structure import ancestor_mask

    ids = list(prompt_ids)
    out = target(torch.tensor([ids]))
    root = int(out.logits[0, -1].argmax())
    for _ in range(after):
        ids.append(root)
        out = target(torch.tensor([ids]))
        root = int(out.logits[0, -1].argmax())
    out = target(torch.tensor([ids]), output_hidden_states=True)
    session = DrafterSession(drafter)
    session.extend(ids, _features(out.hidden_states, session.layer_ids))
    drafted = session.draft(root)
    results = {}
    for name, config in configs.items():
        tree = build_tree(config, drafted.base_logits, drafted.hidden, torch.tensor([root]),
                          drafter.head, drafted.vocab_ids)
        n = int(tree.num_nodes[0])
        tree = tree.narrow(n)
        p0 = len(ids)
        mask = ancestor_mask(tree.parents)                           # [1, 1+n, 1+n]
        causal = torch.ones(p0, p0, dtype=torch.bool).tril()
        full = torch.zeros(p0 + 1 + n, p0 + 1 + n, dtype=torch.bool)
        full[:p0, :p0] = causal
        full[p0:, :p0] = True
        full[p0:, p0:] = mask[0]
        dtype = next(target.parameters()).dtype
        additive = torch.zeros(full.shape, dtype=dtype)
        additive.masked_fill_(~full, torch.finfo(dtype).min)
        seq = torch.tensor([ids + [root] + tree.tokens[0].tolist()])
        positions = torch.cat([torch.arange(p0 + 1), p0 + tree.depths[0]])[None]
        logits = target(seq, position_ids=positions,
                        attention_mask=additive[None, None]).logits[:, p0:].float()
        walk = greedy_walk(tree, logits, mask)
        num = int(walk.num_accepted[0])
        results[name] = (tree, walk.accepted_nodes[0, :num].tolist(), num)
    return ids, root, results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_dartree.reference.picture",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--smollm2", action="store_true",
                        help="target = SmolLM2-135M-Instruct, drafter = the shipped one")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--no-chat-template", action="store_true")
    parser.add_argument("--after", type=int, default=0,
                        help="greedy tokens decoded before the drafted round")
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--width", type=int, default=12)
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.smollm2:
        from vllm_dartree.zoo.shipped import smollm2_pair
        args.target, args.drafter = smollm2_pair(args.target, args.drafter)
    if not (args.target and args.drafter):
        parser.error("give --target and --drafter, or --smollm2")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_dartree.prompts import chat_prompt_ids
    from vllm_dartree.reference.decoder import load_drafter_for, method_config
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    drafter = load_drafter_for(target, args.drafter, torch.float32)
    prompt = chat_prompt_ids(tokenizer, args.prompt, not args.no_chat_template)
    sizes = dict(budget=args.budget, topk=args.topk)
    configs = {"DARTree": method_config("dartree-pruned", width=args.width, **sizes),
               "DDTree": method_config("ddtree", **sizes)}
    ids, root, results = draft_round(target, drafter, prompt, configs, args.after)
    names = {}
    for tree, _, _ in results.values():
        for t in tree.tokens[0].tolist():
            names.setdefault(t, tokenizer.decode([t]))
    panels = [Panel(f"{name}: {int(tree.num_nodes[0])} nodes, {num} accepted", tree, acc,
                    names, tokenizer.decode([root]))
              for name, (tree, acc, num) in results.items()]
    context = tokenizer.decode(ids[len(prompt):]) if len(ids) > len(prompt) else ""
    caption = (f"{args.prompt!r} -> {context!r} | root {tokenizer.decode([root])!r}; budget "
               f"{args.budget}, DARTree width {args.width}, top-K {args.topk}; shade = path "
               "probability under the drafter; orange = accepted by the target (greedy)")
    with open(args.out, "w") as f:
        f.write(render_svg(panels, caption))
    for p in panels:
        print(p.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
