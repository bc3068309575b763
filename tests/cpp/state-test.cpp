// state.h: a window's state through state_dict()/load_state_dict() and
// through archives (save/load), in one process.
#include "test_util.h"

#include "catch_torch.h"

#include <sstream>
#include <type_traits>

using namespace gradaccum;
using gradaccum::test::data;
using gradaccum::test::max_rel_diff;
using gradaccum::test::mlp;
using gradaccum::test::snapshot;

TEST_CASE("a mid-window state round trip resumes identically", "[accumulator][state]") {
  auto d = data(8, torch::kFloat64);
  auto run = [&](bool resume) {
    auto model = mlp();
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    Accumulator acc(model, opt, 4);
    auto parts = gradaccum::split(std::vector<at::Tensor>{d.x, d.y}, 8);
    for (int i = 0; i < 6; ++i) {
      acc.backward((model->forward(parts[i][0]) - parts[i][1]).pow(2).mean());
      acc.step();
    }
    if (resume) {
      auto state = acc.state_dict();
      auto fresh = mlp(torch::kFloat64, 99);
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < fresh->parameters().size(); ++i) fresh->parameters()[i].copy_(model->parameters()[i]);
      torch::optim::SGD fresh_opt(fresh->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      // carry the momentum buffers
      for (size_t i = 0; i < fresh->parameters().size(); ++i) {
        auto& src = static_cast<torch::optim::SGDParamState&>(*opt.state().at(model->parameters()[i].unsafeGetTensorImpl()));
        auto st = std::make_unique<torch::optim::SGDParamState>();
        st->momentum_buffer(src.momentum_buffer().clone());
        fresh_opt.state()[fresh->parameters()[i].unsafeGetTensorImpl()] = std::move(st);
      }
      Accumulator fresh_acc(fresh, fresh_opt, 4);
      fresh_acc.load_state_dict(state);
      CHECK(fresh_acc.micro_step() == 2);
      torch::GradMode::set_enabled(true);
      for (int i = 6; i < 8; ++i) {
        fresh_acc.backward((fresh->forward(parts[i][0]) - parts[i][1]).pow(2).mean());
        fresh_acc.step();
      }
      return snapshot(fresh);
    }
    for (int i = 6; i < 8; ++i) {
      acc.backward((model->forward(parts[i][0]) - parts[i][1]).pow(2).mean());
      acc.step();
    }
    return snapshot(model);
  };
  CHECK(max_rel_diff(run(true), run(false)) == 0);
}


TEST_CASE("save and load through archives resume mid-window exactly", "[accumulator][state]") {
  const int64_t K = 3;
  auto run = [&](bool checkpoint) {
    auto net = gradaccum::test::mlp(torch::kFloat64, 4);
    auto opt = std::make_unique<torch::optim::Adam>(net->parameters(), 0.01);
    auto acc = std::make_unique<Accumulator>(net, *opt, AccumulatorOptions(K).loss_scaler(LossScalerOptions().init_scale(8)));
    for (int i = 0; i < 7; ++i) {
      auto x = torch::full({2, 6}, 0.1 * (i + 1), torch::kFloat64);
      acc->backward(net->forward(x).pow(2).mean());
      acc->step();
      if (checkpoint && i == 4) { // window 1, micro-step 2 of 3
        std::stringstream file;
        torch::serialize::OutputArchive out;
        net->save(out);
        opt->save(out);
        acc->save(out);
        out.save_to(file);
        acc.reset();
        net = gradaccum::test::mlp(torch::kFloat64, 77);
        opt = std::make_unique<torch::optim::Adam>(net->parameters(), 0.01);
        acc = std::make_unique<Accumulator>(net, *opt, AccumulatorOptions(K).loss_scaler(LossScalerOptions().init_scale(8)));
        torch::serialize::InputArchive in;
        in.load_from(file);
        net->load(in);
        opt->load(in);
        acc->load(in);
        CHECK(acc->micro_step() == 2);
      }
    }
    std::vector<at::Tensor> params;
    for (auto& p : net->parameters()) params.push_back(p.detach().clone());
    return std::make_pair(params, acc->stats());
  };
  auto [straight, straight_stats] = run(false);
  auto [resumed, resumed_stats] = run(true);
  CHECK(gradaccum::test::max_rel_diff(resumed, straight) <= 1e-12);
  CHECK(resumed_stats.micro_steps == straight_stats.micro_steps);
  CHECK(resumed_stats.optimizer_steps == straight_stats.optimizer_steps);
  CHECK(resumed_stats.loss_scale == straight_stats.loss_scale);
}

TEST_CASE("a mid-window archive loads only onto the parameters that saved it", "[accumulator][state]") {
  // Note [A held gradient belongs to a named parameter]: two layers of one
  // shape, one trained and the other frozen on each side of the resume.
  auto two_layers = [](int trained) {
    torch::manual_seed(3);
    torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
    for (auto& p : net[1 - trained]->parameters()) {
      p.requires_grad_(false);
    }
    return net;
  };
  auto saving = two_layers(0);
  Accumulator saver(saving.ptr(), AccumulatorOptions(2));
  saver.backward(saving->forward(torch::ones({2, 4})).pow(2).mean());
  std::stringstream file;
  torch::serialize::OutputArchive out;
  saver.save(out);
  out.save_to(file);
  CHECK(saver.state_dict().parameter_names == std::vector<std::string>{"0.weight", "0.bias"});

  auto other = two_layers(1);
  Accumulator resumed(other.ptr(), AccumulatorOptions(2));
  torch::serialize::InputArchive in;
  in.load_from(file);
  CHECK_THROWS_AS(resumed.load(in), c10::ValueError);
  CHECK_THROWS_WITH(resumed.load_state_dict(saver.state_dict()), Catch::StartsWith(
      "gradaccum: acc.load_state_dict(): the state holds the gradients of a window in progress for other trainable "
      "parameters than this Accumulator's (trained when saved, not here: '0.weight', '0.bias'; trained here, not "
      "when saved: '1.weight', '1.bias' (or renamed: the model wrapped in another module?)), so they would land on the wrong parameters. Resume with the trainable parameters that saved it "
      "(the same requires_grad settings), or save at a window boundary (after acc.step() returned True), which "
      "holds no gradient and resumes on any set"));
  CHECK(resumed.micro_step() == 0);
  for (auto& p : other->parameters()) {
    CHECK_FALSE(p.grad().defined());
  }
  auto same = two_layers(0);
  Accumulator again(same.ptr(), AccumulatorOptions(2));
  torch::serialize::InputArchive in_again;
  file.seekg(0);
  in_again.load_from(file);
  again.load(in_again);
  CHECK(again.micro_step() == 1);
  CHECK(torch::equal(same[0]->parameters()[0].grad(), saving[0]->parameters()[0].grad()));
}

TEST_CASE("a damaged archive is an error naming its key, and changes nothing", "[accumulator][state]") {
  // An archive written field by field as save() does, with one value replaced.
  auto net = gradaccum::test::mlp();
  Accumulator acc(net, AccumulatorOptions(2));
  acc.backward(net->forward(torch::ones({2, 6}, torch::kFloat64)).pow(2).mean());
  const auto grad = net->parameters()[0].grad().clone();
  const auto state = acc.state_dict();
  auto load_with = [&](const std::string& bad_key, const c10::IValue& bad) {
    torch::serialize::OutputArchive out;
    auto put = [&](const std::string& key, const c10::IValue& value) {
      if (key == bad_key && bad.isNone()) {
        return; // left out
      }
      out.write(key, key == bad_key ? bad : value);
    };
    gradaccum::for_each_state_field(state, [&](const char* name, const auto& field, bool) {
      using T = std::decay_t<decltype(field)>;
      if constexpr (std::is_same_v<T, Reduction>) {
        put(std::string("gradaccum.") + name, c10::IValue(static_cast<int64_t>(field)));
      } else {
        put(std::string("gradaccum.") + name, c10::IValue(field));
      }
    });
    put("gradaccum.grads", c10::IValue(int64_t{0}));
    std::stringstream file;
    out.save_to(file);
    torch::serialize::InputArchive in;
    in.load_from(file);
    acc.load(in);
  };
  CHECK_THROWS_WITH(load_with("gradaccum.micro_step", c10::IValue(std::string("1"))),
      Catch::StartsWith("gradaccum: acc.load(): the archive's gradaccum.micro_step must be an integer, got String"));
  CHECK_THROWS_WITH(load_with("gradaccum.window_ready", c10::IValue(int64_t{1})),
      Catch::StartsWith("gradaccum: acc.load(): the archive's gradaccum.window_ready must be a bool, got Int"));
  CHECK_THROWS_WITH(load_with("gradaccum.reduction", c10::IValue(int64_t{7})),
      Catch::StartsWith("gradaccum: acc.load(): the archive's gradaccum.reduction is 7, which names no reduction"));
  CHECK_THROWS_WITH(load_with("gradaccum.grads", c10::IValue(int64_t{-5})),
      Catch::StartsWith("gradaccum: acc.load(): the archive's gradaccum.grads is -5, not a count"));
  CHECK_THROWS_AS(load_with("gradaccum.steps", c10::IValue(3.5)), c10::ValueError);
  // A key save() always writes, missing: a c10 error naming it, not torch's
  // ObjectAttributeError (a std::runtime_error only).
  CHECK_THROWS_WITH(load_with("gradaccum.windows", c10::IValue()),
      Catch::StartsWith("gradaccum: acc.load(): the archive's gradaccum.windows is missing (a damaged archive, or "
                        "not one acc.save() wrote)"));
  CHECK_THROWS_AS(load_with("gradaccum.grads", c10::IValue()), c10::ValueError);
  {
    // The model's archive alone (acc.save() forgotten)
    torch::serialize::OutputArchive out;
    net->save(out);
    std::stringstream file;
    out.save_to(file);
    torch::serialize::InputArchive in;
    in.load_from(file);
    CHECK_THROWS_WITH(acc.load(in),
        Catch::StartsWith("gradaccum: acc.load(): the archive holds no Accumulator state (no gradaccum.steps): "
                          "write it with acc.save(archive) beside the model's and the optimizer's"));
  }
  auto no_steps = state;
  no_steps.steps = 0;
  CHECK_THROWS_WITH(acc.load_state_dict(no_steps),
      Catch::StartsWith("gradaccum: acc.load_state_dict(): the state's steps is 0 (a window has steps > 0)"));
  auto bad_reduction = state;
  bad_reduction.reduction = static_cast<Reduction>(9);
  CHECK_THROWS_WITH(acc.load_state_dict(bad_reduction),
      Catch::StartsWith("gradaccum: acc.load_state_dict(): the state's reduction is 9, which names no reduction"));
  CHECK(acc.micro_step() == 1);
  CHECK(torch::equal(net->parameters()[0].grad(), grad));
}

TEST_CASE("an archive cut in a window keeps its loss and metrics, by the metrics' names", "[accumulator][state]") {
  // Note [The window's loss across a checkpoint]: the resumed window reports
  // the uninterrupted one's loss and metrics; an Accumulator with other
  // metric names reports neither (review: the sums were credited by position).
  auto net = gradaccum::test::mlp();
  const auto x = torch::ones({2, 6}, torch::kFloat64);
  Accumulator saver(net, AccumulatorOptions(2).metrics({"rows", "tokens"}));
  const auto first = net->forward(x).pow(2).mean();
  saver.backward(first, std::nullopt, first, torch::tensor({2.0, 30.0}, torch::kFloat64));
  std::stringstream file;
  torch::serialize::OutputArchive out;
  saver.save(out);
  out.save_to(file);
  saver.zero_grad();
  saver.close();
  for (const auto& names : {std::vector<std::string>{"rows", "tokens"}, std::vector<std::string>{"tokens", "rows"}}) {
    Accumulator resumed(net, AccumulatorOptions(2).metrics(names));
    torch::serialize::InputArchive in;
    file.clear();
    file.seekg(0);
    in.load_from(file);
    resumed.load(in);
    const auto second = net->forward(x).pow(2).mean();
    resumed.backward(second, std::nullopt, second, torch::tensor({3.0, 40.0}, torch::kFloat64));
    REQUIRE(resumed.window_ready());
    if (names.front() == "rows") {
      REQUIRE(resumed.window_loss().has_value());
      CHECK(resumed.window_loss()->item<double>() == Approx((first.item<double>() + second.item<double>()) / 2));
      CHECK(torch::equal(*resumed.window_metrics(), torch::tensor({5.0, 70.0}, torch::kFloat64)));
    } else {
      CHECK_FALSE(resumed.window_loss().has_value());
      CHECK_FALSE(resumed.window_metrics().has_value());
    }
    resumed.zero_grad();
    resumed.close();
  }
}
