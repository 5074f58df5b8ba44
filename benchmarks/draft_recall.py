"""Where a head's first draft token misses, on held-out features: recall of the target's greedy token in the head's
top 1 / 3 / 10 over its draft vocabulary and, for a head whose lm_head is the target's (EAGLE-1/2, or EAGLE-3 trained
with --freeze-lm-head), over the full vocabulary; the share of target tokens outside the draft vocabulary; and the
training log's accuracy at each training-time-test pass (depth s reads the head's own outputs at depths 1..s-1),
past the passes it was trained on.

    python benchmarks/draft_recall.py --head model_cards/smollm2-135m-instruct-eagle2 \
        --val runs/data/distill-val-fp32feat --passes 1

`--max-prompt-context N` reads each held-out row from N positions before its first answer token, as
`train --max-prompt-context N` trains: the same answer positions, with less of the prompt for the head to attend
to. What the head's numbers lose then bounds what training on such rows costs a head that reads whole prompts.

`--val` is a feature folder (`extract` or `rebuild-features`; EAGLE-3 heads need one written with --eagle3).
"""

import argparse

import torch

from hf_eagle2 import EagleDraftModel
from hf_eagle2.evaluation.assets import load_model
from hf_eagle2.heads.modeling_eagle3 import Eagle3DraftModel
from hf_eagle2.training.train import FeatureSet, eagle_loss, epoch_batches

TOP = (1, 3, 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", required=True)
    parser.add_argument("--val", required=True, help="held-out feature folder")
    parser.add_argument("--batches", type=int, default=40, help="held-out batches of 4,096 tokens read")
    parser.add_argument("--passes", type=int, default=6, help="training-time-test passes measured")
    parser.add_argument("--max-prompt-context", type=int, default=None, help="prompt positions kept per row")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, _ = load_model("smollm2", dtype="float32")
    head = EagleDraftModel.from_pretrained(args.head).bind(model).float().eval()
    eagle3 = isinstance(head, Eagle3DraftModel)
    val = FeatureSet.load([args.val], 1024, eagle3, args.max_prompt_context)
    batches = [val.batch(i) for i in epoch_batches(val.lengths(), 4096, 0, 0)[: args.batches]]
    target_head = model.get_output_embeddings().weight.detach().float()  # (V, H); SmolLM2's lm_head has no bias
    draft_ids = head.to_target_ids(torch.arange(head.draft_vocab_size))
    in_draft = torch.zeros(target_head.shape[0], dtype=torch.bool)
    in_draft[draft_ids] = True
    # an EAGLE-3 head trained on the target's frozen rows (train --freeze-lm-head) scores any vocabulary with them
    borrowed = not eagle3 or head.lm_head_is_targets()
    vocabularies = ["draft", "full"] if borrowed else ["draft"]
    hits = {v: torch.zeros(len(TOP)) for v in vocabularies}
    outside = total = 0
    with torch.no_grad():
        for b in batches:
            steps = b["ids"].shape[1] - 1
            positions = torch.arange(steps).expand(b["ids"].shape[0], steps)
            inputs = head.project_features((b["aux"] if eagle3 else b["features"])[:, :-1])
            out, _ = head(None, inputs, positions, inputs_embeds=head.embed(b["ids"][:, 1:]))
            sel = b["mask"][:, 1:]
            greedy = (b["features"][:, 1:][sel] @ target_head.T).argmax(-1)  # (N,) the target's next token
            ranked = {"draft": head.to_target_ids(head.draft_logits(out[sel]).topk(max(TOP), -1).indices)}
            if borrowed:
                normed = head.norm(out[sel]) if eagle3 else out[sel]
                ranked["full"] = (normed @ target_head.T).topk(max(TOP), -1).indices
            for v, top in ranked.items():
                hits[v] += torch.tensor([(top[:, :k] == greedy[:, None]).any(-1).sum().item() for k in TOP])
            outside += int((~in_draft[greedy]).sum())
            total += greedy.numel()
        print(f"{total:,} held-out positions; target token outside the {draft_ids.numel():,}-token draft vocabulary: "
              f"{outside / total:.2%}")  # fmt: skip
        for v in vocabularies:
            print(f"{v:>5} vocabulary: " + ", ".join(f"top-{k} {h / total:.4f}" for k, h in zip(TOP, hits[v].tolist())))
        lm_weight = target_head[draft_ids]
        for passes in range(1, args.passes + 1):
            right = seen = 0
            for b in batches:
                _, info = eagle_loss(head, lm_weight, b, 0.0, 0.1, unroll=passes)
                right += info["acc_deep" if passes > 1 else "acc"] * info["tokens"]
                seen += info["tokens"]
            print(f"pass {passes}: accuracy {right / seen:.4f}")


if __name__ == "__main__":
    main()
