#pragma once
// Note [Catch's CHECK, not c10's]
// c10's logging header, which torch's headers include, defines CHECK too: a
// fatal log check. Where it wins, a failing CHECK aborts the whole run at the
// first failure, and Catch neither counts nor reports any of them. So every
// Catch2 test includes this header instead of <catch2/catch.hpp>: torch's
// headers first, Catch's last, and a later torch include finds c10's header
// already read (tests/python/test_packaging.py checks that no test includes
// Catch directly).
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <string_view>

#define GRADACCUM_TEST_SPELL_(...) #__VA_ARGS__
#define GRADACCUM_TEST_SPELL(...) GRADACCUM_TEST_SPELL_(__VA_ARGS__)
static_assert(std::string_view(GRADACCUM_TEST_SPELL(CHECK(true))).find("Catch::") != std::string_view::npos,
              "CHECK is not Catch's: see Note [Catch's CHECK, not c10's]");
