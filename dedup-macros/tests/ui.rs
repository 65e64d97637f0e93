//! Every compile error of `#[idempotent]` lands on the user's token with a
//! message that says what to write; the accepted forms compile.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
