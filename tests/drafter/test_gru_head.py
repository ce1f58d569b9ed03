"""The Domino GRU head: PyTorch GRU semantics, candidate scoring equals the full product."""

import torch

from vllm_dartree.drafter import DominoGRUHead

H, G, E, V = 12, 10, 6, 30


def _head(seed=0):
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, H, generator=gen, dtype=torch.float64)
    head = DominoGRUHead(H, G, E, V, embed).double()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return head, embed


def test_gru_step_equals_torch_gru_cell():
    head, embed = _head()
    cell = torch.nn.GRUCell(H, G, bias=False).double()
    with torch.no_grad():
        cell.weight_ih.copy_(head.w_ih)
        cell.weight_hh.copy_(head.w_hh)
    state = torch.randn(7, G, dtype=torch.float64)
    tokens = torch.randint(0, V, (7,))
    with torch.no_grad():
        torch.testing.assert_close(head.gru_step(state, tokens), cell(embed[tokens], state))
        root = torch.tensor([3, 4])
        torch.testing.assert_close(head.init(root)[:, 0],
                                   cell(embed[root], torch.zeros(2, G, dtype=torch.float64)))


def test_candidate_scores_equal_the_full_vocabulary_correction():
    head, _ = _head(1)
    num_req, depth, k, p = 3, 4, 5, 2
    hidden = torch.randn(num_req, depth, H, dtype=torch.float64)
    cand = torch.stack([torch.randperm(V)[:k] for _ in range(num_req * depth)]).view(
        num_req, depth, k)
    state = torch.randn(num_req, p, G, dtype=torch.float64)
    with torch.no_grad():
        prep = head.prepare(hidden, cand)
        for d in range(depth):
            got = head.score(prep, d, state)                                  # [R, P, K]
            full = head.correction(hidden[:, d, None].expand(-1, p, -1), state)  # [R, P, V]
            torch.testing.assert_close(got, torch.gather(full, 2, cand[:, d, None].expand(-1, p, -1)))


def test_input_table_fast_path_is_equal():
    head, _ = _head(2)
    state = torch.randn(4, 3, G, dtype=torch.float64)
    tokens = torch.randint(0, V, (4, 3))
    with torch.no_grad():
        plain = head.advance(state, tokens)
        head.use_input_table()
        fast = head.advance(state, tokens)
        head.use_input_table(False)
    torch.testing.assert_close(plain, fast)


def test_input_table_over_a_draft_vocabulary_is_equal_inside_and_outside_it():
    """The table restricted to some target ids (a reduced draft vocabulary's) gives the same
    GRU step for tokens it holds and for tokens it does not (a root outside it)."""
    head, _ = _head(5)
    ids = torch.tensor([1, 4, 7, 9])
    state = torch.randn(3, 4, G, dtype=torch.float64)
    inside = ids[torch.randint(0, len(ids), (3, 4))]
    mixed = inside.clone()
    mixed[0, 1], mixed[2, 3] = 0, V - 1            # outside the table
    with torch.no_grad():
        want_inside, want_mixed = head.advance(state, inside), head.advance(state, mixed)
        head.use_input_table(ids=ids)
        assert head._input_table.shape == (len(ids), 3 * G)
        got_inside, got_mixed = head.advance(state, inside), head.advance(state, mixed)
        got_root = head.init(torch.tensor([0, 4]))
        head.use_input_table(False)
        want_root = head.init(torch.tensor([0, 4]))
    torch.testing.assert_close(got_inside, want_inside)
    torch.testing.assert_close(got_mixed, want_mixed)
    torch.testing.assert_close(got_root, want_root)


def test_embedding_is_shared_not_copied():
    head, embed = _head(3)
    assert head.embed_weight.data_ptr() == embed.data_ptr()
    assert "embed_weight" not in head.state_dict()
    assert set(head.state_dict()) == {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0",
                                      "embed_proj.0.weight", "embed_proj.2.weight"}


def test_moving_the_head_moves_its_embeddings_and_input_table():
    """`.to()` / `.cuda()` must carry the plain-attribute tensors too (a GPU run found
    `.cuda()` leaving them on the CPU: "indices should be ... on the same device")."""
    head, embed = _head(4)
    state = torch.randn(2, 3, G, dtype=torch.float64)
    tokens = torch.randint(0, V, (2, 3))
    with torch.no_grad():
        want = head.advance(state, tokens)
        head.use_input_table()
        head.float()
        assert head.embed_weight.dtype == torch.float32 == head._input_table.dtype
        fast = head.advance(state.float(), tokens)
        head.use_input_table(False)
        plain = head.advance(state.float(), tokens)
    torch.testing.assert_close(fast, want.float())
    torch.testing.assert_close(plain, want.float())
    assert embed.dtype == torch.float64      # the caller's tensor is left as it was
