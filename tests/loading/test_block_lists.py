"""Which ModuleLists of a model are its repeated blocks: the lists that stream."""

from __future__ import annotations

from torch import nn

from ondeck.loading.blocks import find_block_lists, find_blocks


class Block(nn.Module):
    def __init__(self, width: int, inner: int = 0):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.inner = nn.ModuleList(nn.Linear(width, width) for _ in range(inner))


class Other(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)


def model(**lists: nn.ModuleList) -> nn.Module:
    holder = nn.Module()
    for name, value in lists.items():
        setattr(holder, name, value)
    return holder


def test_a_list_inside_each_block_is_part_of_the_block_not_a_list_of_its_own():
    blocks = nn.ModuleList(Block(16, inner=2) for _ in range(3))
    found = find_block_lists(model(blocks=blocks))
    assert found.paths == ("blocks",)
    assert found.counts == (3,)


def test_a_list_of_blocks_of_two_classes_is_not_repeated_blocks():
    mixed = nn.ModuleList([Block(64), Other(64), Block(64)])
    assert find_block_lists(model(mixed=mixed)) is None
    assert find_blocks(model(mixed=mixed, blocks=nn.ModuleList(Block(8) for _ in range(2)))) == (
        "blocks"
    ), "the only list of one class, though the mixed one is larger"


def test_a_list_of_a_few_percent_of_the_weights_is_left_resident():
    main = nn.ModuleList(Block(64) for _ in range(4))  # 4 x 64 x 65 weights
    refiner = nn.ModuleList(Block(8) for _ in range(2))  # under 1% of them
    found = find_block_lists(model(blocks=main, refiner=refiner))
    assert found.paths == ("blocks",)


def test_the_largest_list_is_the_one_of_most_bytes_not_most_blocks():
    many_small = nn.ModuleList(Block(8) for _ in range(6))
    few_large = nn.ModuleList(Block(64) for _ in range(2))
    assert find_blocks(model(small=many_small, large=few_large)) == "large"


def test_a_list_of_modules_without_weights_is_no_block_list():
    assert find_block_lists(model(acts=nn.ModuleList([nn.ReLU(), nn.ReLU()]))) is None
    assert find_blocks(model(acts=nn.ModuleList([nn.ReLU(), nn.ReLU()]))) is None


def test_both_lists_of_a_two_list_model_are_found_in_definition_order():
    double = nn.ModuleList(Block(32) for _ in range(2))
    single = nn.ModuleList(Other(32) for _ in range(4))
    found = find_block_lists(model(double=double, single=single))
    assert found.paths == ("double", "single")
    assert found.counts == (2, 4)
