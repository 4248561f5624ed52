"""The policies as a visitor picks them: by kind from what each declares, named sets, and hover text."""
import app
from backend.policies import POLICIES
from viz.policy_menu import KINDS, SETS, by_kind, descriptions, hover_script, kind_of


def test_every_policy_but_full_has_one_kind_from_its_declarations():
    kinds = by_kind(POLICIES)
    assert list(kinds) == [kind for kind, _ in KINDS]
    listed = [name for members in kinds.values() for name in members]
    assert sorted(listed) == sorted(n for n in POLICIES if n != "full") and len(listed) == len(set(listed))
    assert {"sinks", "h2o", "tova"} <= set(kinds["eviction"]) and {"quest", "sparq"} <= set(kinds["selection"])
    assert {"kivi", "gear", "cam", "think"} <= set(kinds["held"]) and "snapkv" in kinds["compression"]


def test_a_plugin_lands_in_its_kind_by_what_it_declares():
    class Rounds(POLICIES["snapkv"]):  # a compression policy that declares it holds tokens in another precision
        reforms = "precision"

    class Walks(POLICIES["tova"]):
        pass

    assert kind_of(Rounds) == "held" and kind_of(Walks) == "eviction" and kind_of(POLICIES["full"]) == ""


def test_named_sets_fit_the_page_and_name_registered_policies():
    for label, members in SETS:
        assert set(members) <= set(POLICIES) and len(members) <= app.LIMITS.policies, label
    assert list(SETS[0][1]) == app.DEFAULT_POLICIES


def test_the_kinds_boxes_and_the_named_sets_write_one_list():
    assert app.merge_kinds(["tova", "sinks"], [], ["quest"], ["kivi"]) == ["sinks", "tova", "quest", "kivi"]
    *boxes, named = app.split_kinds(["sinks", "h2o", "tova"])
    assert named == SETS[1][0] and boxes[0] == ["sinks", "h2o", "tova"] and boxes[1:] == [[], [], []]
    assert app.split_kinds(["tova", "kivi"])[-1] == app.OWN_PICK
    assert app.named_set(SETS[3][0]) == ["quest", "sparq", "reattention"]


def test_hover_text_is_each_policys_line_and_paper_and_cannot_close_the_script():
    about = descriptions(POLICIES)
    assert POLICIES["tova"].paper in about["tova"] and POLICIES["tova"].summary in about["tova"]
    script = hover_script({"x": type("P", (), {"summary": "</script><b>", "paper": ""})}, "#policies")
    assert script.count("</script>") == 1
