//! `#[needs_root]`, the root guard of the workspace's tests; use it as
//! `test_support::needs_root`, which documents it.

use proc_macro::{Delimiter, Group, Ident, TokenStream, TokenTree};

/// Why a test is ignored when built without root; libtest prints it after `ignored,`.
const IGNORED: &str = "needs root (network namespaces, cgroup v2, bpffs and BPF), and this test \
                       was built as another user: build and run it as root, e.g. `cargo xtask test`";

/// Put above a test's `#[test]` (or `#[tokio::test]`): built as root, the test runs and
/// first checks that it still runs as root (failing, saying why, if not); built as another
/// user, it is `#[ignore]`d with the reason.
#[proc_macro_attribute]
pub fn needs_root(args: TokenStream, item: TokenStream) -> TokenStream {
    match expand(args, item) {
        Ok(tokens) => tokens,
        Err(why) => format!("::core::compile_error!({why:?});")
            .parse()
            .expect("compile_error tokens"),
    }
}

fn expand(args: TokenStream, item: TokenStream) -> Result<TokenStream, String> {
    if !args.is_empty() {
        return Err("#[needs_root] takes no arguments".into());
    }
    let mut tokens: Vec<TokenTree> = item.into_iter().collect();
    if !has_test_attribute(&tokens) {
        return Err(
            "#[needs_root] goes above the test's #[test] or #[tokio::test] (it must see it)".into(),
        );
    }
    let name = fn_name(&tokens).ok_or("#[needs_root] is for test functions")?;
    let Some(TokenTree::Group(body)) = tokens.last() else {
        return Err("#[needs_root]: the function has no body".into());
    };
    if body.delimiter() != Delimiter::Brace {
        return Err("#[needs_root]: the function has no body".into());
    }
    let mut guarded: TokenStream = format!("::test_support::assert_root({:?});", name.to_string())
        .parse()
        .expect("guard tokens");
    guarded.extend(body.stream());
    let mut new_body = Group::new(Delimiter::Brace, guarded);
    new_body.set_span(body.span());
    *tokens.last_mut().expect("a body") = TokenTree::Group(new_body);

    let mut out = TokenStream::new();
    if !cfg!(proxy_root) {
        out.extend(
            format!("#[ignore = {IGNORED:?}]")
                .parse::<TokenStream>()
                .expect("ignore attribute"),
        );
    }
    out.extend(tokens);
    Ok(out)
}

/// Whether one of the item's own attributes is a test attribute (`test`, `tokio::test`, …).
fn has_test_attribute(tokens: &[TokenTree]) -> bool {
    tokens.windows(2).any(|w| match w {
        [TokenTree::Punct(p), TokenTree::Group(g)]
            if p.as_char() == '#' && g.delimiter() == Delimiter::Bracket =>
        {
            let path: Vec<String> = g
                .stream()
                .into_iter()
                .take_while(|t| !matches!(t, TokenTree::Group(_)))
                .filter_map(|t| match t {
                    TokenTree::Ident(i) => Some(i.to_string()),
                    _ => None,
                })
                .collect();
            path.last().is_some_and(|last| last == "test")
        }
        _ => false,
    })
}

/// The identifier after `fn`.
fn fn_name(tokens: &[TokenTree]) -> Option<Ident> {
    tokens.windows(2).find_map(|w| match w {
        [TokenTree::Ident(f), TokenTree::Ident(name)] if f.to_string() == "fn" => {
            Some(name.clone())
        }
        _ => None,
    })
}
