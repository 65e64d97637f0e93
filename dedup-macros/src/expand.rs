//! Generating the handler value from the annotated function.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{FnArg, ItemFn, Type};

use crate::attr::{self, Args, Decode, FingerprintSource, KeyPart, KeySource};
use crate::errors::Errors;

pub(crate) fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    let func: ItemFn = match syn::parse2(item.clone()) {
        Ok(func) => func,
        // Not a function at all: let rustc report on the item as written.
        Err(e) => return token_stream_with_error(item, e),
    };
    let mut errors = Errors::default();
    let attr_tokens = attr.clone();
    let args = errors.ok(attr::parse(attr));
    // Read from the tokens, so the signature is checked for the mode the
    // user asked for even when an option's value is refused.
    let batch = names_option(&attr_tokens, "batch");
    let lease = names_option(&attr_tokens, "lease");
    let signature = errors.ok(check_signature(&func, batch, lease));
    match (errors.finish(), args, signature) {
        (Ok(()), Some(args), Some(signature)) => generate(&args, &func, &signature),
        (result, ..) => {
            let error = result.expect_err("a part failed, so an error was recorded");
            token_stream_with_error(func.into_token_stream(), error)
        }
    }
}

/// Whether the attribute's top level names the option `name`.
fn names_option(attr: &TokenStream, name: &str) -> bool {
    attr.clone()
        .into_iter()
        .any(|token| matches!(token, proc_macro2::TokenTree::Ident(ident) if ident == name))
}

/// The original item plus the errors, so IDEs still see the function.
fn token_stream_with_error(mut item: TokenStream, error: syn::Error) -> TokenStream {
    item.extend(error.into_compile_error());
    item
}

/// What the handler's parameters say.
struct Signature<'a> {
    /// The transaction type (or, in lease mode, `Lease`).
    tx: &'a Type,
    /// The event type (of a batch body: the element of its `Vec`).
    event: &'a Type,
    /// It takes the record's metadata last: `meta: &Meta` (a batch body
    /// `meta: &[Meta]`).
    meta: bool,
}

/// Checks `async fn name(tx: &mut Tx, event: Event) -> ...` (in lease mode
/// `lease: &Lease` first), optionally with `meta: &Meta` last (`&[Meta]`
/// with `batch`), and returns what it found.
fn check_signature(func: &ItemFn, batch: bool, lease: bool) -> syn::Result<Signature<'_>> {
    let sig = &func.sig;
    let mut errors = Errors::default();
    if sig.asyncness.is_none() {
        errors.push(syn::Error::new(
            sig.fn_token.span,
            "#[idempotent] handlers must be `async fn`",
        ));
    }
    if !sig.generics.params.is_empty() {
        errors.push(syn::Error::new(
            sig.generics.span(),
            "#[idempotent] handlers cannot be generic: the runtime needs one event type and one transaction type",
        ));
    }
    if let Some(receiver) = sig.receiver() {
        errors.push(syn::Error::new(
            receiver.self_token.span,
            "#[idempotent] goes on a free function, not a method: remove `self`",
        ));
    }
    let typed: Vec<&syn::PatType> = sig
        .inputs
        .iter()
        .filter_map(|arg| match arg {
            FnArg::Typed(t) => Some(t),
            FnArg::Receiver(_) => None,
        })
        .collect();
    let mut types = None;
    if sig.receiver().is_none() {
        let first = if lease {
            "`lease: &Lease`"
        } else {
            "`tx: &mut <transaction>`"
        };
        let meta_form = if batch {
            "`meta: &[Meta]`"
        } else {
            "`meta: &Meta`"
        };
        if typed.len() == 3 && !is_meta(&typed[2].ty, batch) {
            errors.push(syn::Error::new(
                typed[2].ty.span(),
                format!(
                    "the third parameter, if any, is the record's metadata: {meta_form} (`dedup_core::Meta`)"
                ),
            ));
        }
        if typed.len() != 2 && typed.len() != 3 {
            errors.push(syn::Error::new(
                sig.paren_token.span.join(),
                format!(
                    "#[idempotent] handlers take two parameters, {first} and `event: <event type>`, and optionally {meta_form}; found {}",
                    typed.len()
                ),
            ));
        } else if lease {
            match &*typed[0].ty {
                Type::Reference(r) if r.mutability.is_none() => {
                    types = Some((&*r.elem, &*typed[1].ty));
                }
                other => errors.push(syn::Error::new(
                    other.span(),
                    "with `lease`, the first parameter is the lease, shared: `lease: &Lease` (`dedup_core::Lease`)",
                )),
            }
        } else if let Type::Reference(r) = &*typed[0].ty {
            if r.mutability.is_none() {
                errors.push(syn::Error::new(
                    r.span(),
                    "the first parameter is the transaction and must be `&mut`",
                ));
            } else {
                let event = &*typed[1].ty;
                if batch {
                    match vec_element(event) {
                        Some(element) => types = Some((&*r.elem, element)),
                        None => errors.push(syn::Error::new(
                            event.span(),
                            "with `batch`, the second parameter takes the events of a batch: `events: Vec<Event>`",
                        )),
                    }
                } else {
                    types = Some((&*r.elem, event));
                }
            }
        } else {
            errors.push(syn::Error::new(
                typed[0].ty.span(),
                "the first parameter is the transaction, `tx: &mut <transaction>`",
            ));
        }
    }
    errors.finish()?;
    let (tx, event) = types.expect("set when no error");
    Ok(Signature {
        tx,
        event,
        meta: typed.len() == 3,
    })
}

/// Whether `ty` is `&Meta` (`&[Meta]` for a batch body): a shared
/// reference to a path that ends in `Meta` (`Meta`, `dedup_core::Meta`).
fn is_meta(ty: &Type, batch: bool) -> bool {
    let Type::Reference(r) = ty else { return false };
    if r.mutability.is_some() {
        return false;
    }
    let inner = match (&*r.elem, batch) {
        (Type::Slice(slice), true) => &*slice.elem,
        (other, false) => other,
        _ => return false,
    };
    matches!(inner, Type::Path(p) if p.qself.is_none() && p.path.segments.last().is_some_and(|s| s.ident == "Meta" && s.arguments.is_empty()))
}

/// `T` of a `Vec<T>` type.
fn vec_element(ty: &Type) -> Option<&Type> {
    let Type::Path(path) = ty else { return None };
    let last = path.path.segments.last()?;
    if last.ident != "Vec" {
        return None;
    }
    match &last.arguments {
        syn::PathArguments::AngleBracketed(args) if args.args.len() == 1 => match &args.args[0] {
            syn::GenericArgument::Type(element) => Some(element),
            _ => None,
        },
        _ => None,
    }
}

fn generate(args: &Args, func: &ItemFn, signature: &Signature<'_>) -> TokenStream {
    let Signature { tx, event, meta } = *signature;
    let krate = args
        .krate
        .as_ref()
        .map_or_else(|| quote!(::dedup_core), ToTokens::to_token_stream);
    let private = quote!(#krate::__private);
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
    } = func;
    let name = &sig.ident;
    // Docs and deprecation describe the handler value, so they go on the
    // struct that users name; `cfg` must remove every generated item with
    // the function; everything else (lint levels, `#[tracing::instrument]`,
    // ...) is about the body, on `call`.
    let is = |attr: &&syn::Attribute, name: &str| attr.path().is_ident(name);
    let on_struct = |a: &&syn::Attribute| is(a, "doc") || is(a, "deprecated");
    let cfgs: Vec<_> = attrs.iter().filter(|a| is(a, "cfg")).collect();
    let docs: Vec<_> = attrs.iter().filter(on_struct).collect();
    let body_attrs: Vec<_> = attrs
        .iter()
        .filter(|a| !is(a, "cfg") && !on_struct(a))
        .collect();
    let inputs = &sig.inputs;
    let output = &sig.output;
    let ttl_secs = args.ttl_secs;

    let scope = match &args.scope {
        Some(lit) => quote!(#lit),
        None => {
            let suffix = format!("::{name}");
            quote!(#private::concat!(#private::module_path!(), #suffix))
        }
    };

    let key_span = args.key_lit.span();
    // A handler that takes its record's metadata has `WithMeta<Event>` as
    // its event: fields are read from the inner event.
    let inner = if meta { quote!(.event) } else { quote!() };
    let part_expr = |part: &KeyPart| match &part.source {
        KeySource::Field(path) => {
            // Spanned at the `key` literal, so a path that is not a field of
            // the event is reported on the string the user wrote.
            let text = &part.text;
            quote_spanned! {key_span=> {
                #[allow(unused_imports)]
                use #private::{KeyFromDisplay as _, KeyFromOption as _};
                (&&event #inner #(.#path)*).dedup_key_string(#text)
            }}
        }
        KeySource::Header(header) => quote! {
            #private::key_from_header(headers, #header)
        },
    };
    let key_body = match &args.key[..] {
        [part] => part_expr(part),
        parts => {
            let pairs = parts.iter().map(|part| {
                let text = &part.text;
                let value = part_expr(part);
                quote!((#text, #value?))
            });
            quote!(#private::composite_key(&[#(#pairs),*]))
        }
    };
    let is_field = |part: &KeyPart| matches!(part.source, KeySource::Field(_));
    let uses_event = if args.key.iter().any(is_field) {
        quote!(event)
    } else {
        quote!(_event)
    };
    let uses_headers = if args.key.iter().all(is_field) {
        quote!(_headers)
    } else {
        quote!(headers)
    };
    let fingerprint_fn = args.fingerprint.as_ref().map(|source| {
        let (uses_event, uses_payload, body) = match source {
            FingerprintSource::Payload => (
                quote!(_event),
                quote!(payload),
                quote!(#private::Fingerprint::of_payload(payload)),
            ),
            FingerprintSource::Fields(fields, span) => {
                let n = fields.len();
                let parts = fields.iter().map(|(_, path)| {
                    quote_spanned! {*span=>
                        (&&event #inner #(.#path)*).fingerprint_part()
                    }
                });
                // The field paths are checked like the key's: spanned at
                // the attribute, so a typo is reported there.
                (
                    quote!(event),
                    quote!(_payload),
                    quote! {{
                        #[allow(unused_imports)]
                        use #private::{FingerprintFromDisplay as _, FingerprintFromOption as _};
                        let parts: [#private::Option<#private::String>; #n] = [#(#parts),*];
                        #private::Fingerprint::of_parts(parts.iter().map(#private::Option::as_deref))
                    }},
                )
            }
        };
        quote! {
            fn fingerprint(
                &self,
                #uses_event: &Self::Event,
                #uses_payload: &[u8],
            ) -> #private::Option<#private::Fingerprint> {
                #private::Some(#body)
            }
        }
    });
    // The decoder goes through a function pointer of the event type: a
    // `decode` function that makes another type is reported on its name,
    // and an event that Protobuf cannot make on the attribute, with a
    // message naming the missing feature. Only the decoder's path carries
    // the user's span; `payload` keeps the call site's, so it resolves even
    // when a `macro_rules!` writes the attribute.
    let decoder = match &args.decode {
        Decode::Json => quote!(#private::decode_json),
        Decode::Protobuf(span) => {
            let function = syn::Ident::new("decode_protobuf", *span);
            quote!(#private::#function)
        }
        Decode::With(path) => quote!(#path),
    };
    let decode_body = match &args.decode {
        Decode::With(_) => quote! {
            let decode: fn(&[u8]) -> #private::Result<#event, _> = #decoder;
            #private::decode_with(payload, decode)
        },
        Decode::Json | Decode::Protobuf(_) => quote! {
            let decode: fn(&[u8]) -> #private::Result<#event, #private::Error> = #decoder;
            decode(payload)
        },
    };
    let decode_fn = if meta {
        quote! {
            fn decode(
                &self,
                payload: &[u8],
            ) -> #private::Result<Self::Event, #private::Error> {
                self.decode_record(payload, &())
            }

            fn decode_record(
                &self,
                payload: &[u8],
                headers: &dyn #private::Headers,
            ) -> #private::Result<Self::Event, #private::Error> {
                let event = { #decode_body }?;
                let meta = #private::Option::map_or_else(
                    #private::Headers::meta(headers),
                    #private::Meta::default,
                    #private::Clone::clone,
                );
                #private::Ok(#private::WithMeta { event, meta })
            }
        }
    } else {
        quote! {
            fn decode(
                &self,
                payload: &[u8],
            ) -> #private::Result<Self::Event, #private::Error> {
                #decode_body
            }
        }
    };
    let event_type = if meta {
        quote!(#private::WithMeta<#event>)
    } else {
        quote!(#event)
    };
    let call = format_ident!("call", span = Span::call_site());
    let output_span = output.span();
    let into = quote_spanned! {output_span=> #private::Result::map_err(result, ::core::convert::Into::<#private::HandlerError>::into) };

    // A batch body takes Vec<Event>: a single event arrives as a Vec of one,
    // and the whole batch through handle_batch. A body that takes its
    // record's metadata gets it beside the event (a batch body, a slice of
    // them in the events' order).
    let single = match (args.batch, meta) {
        (true, true) => quote!(#private::vec![event.event], ::core::slice::from_ref(&event.meta)),
        (true, false) => quote!(#private::vec![event]),
        (false, true) => quote!(event.event, &event.meta),
        (false, false) => quote!(event),
    };
    let handle_batch = args.batch.then(|| {
        let call_batch = if meta {
            quote! {
                let (events, meta): (#private::Vec<_>, #private::Vec<_>) =
                    ::core::iter::Iterator::unzip(::core::iter::IntoIterator::into_iter(events).map(|e| (e.event, e.meta)));
                let result = #name::#call(tx, events, &meta).await;
            }
        } else {
            quote!(let result = #name::#call(tx, events).await;)
        };
        quote! {
            async fn handle_batch(
                &self,
                tx: &mut Self::Tx,
                events: #private::Vec<Self::Event>,
            ) -> #private::Result<(), #private::HandlerError> {
                #call_batch
                #into
            }
        }
    });
    // Without `batch`, a batch is one `handle` per event: a runtime may run
    // each in its own context.
    let takes_batches = (!args.batch).then(|| {
        quote! {
            fn takes_batches(&self) -> bool {
                false
            }
        }
    });
    let handle_fns = quote! {
        #takes_batches

        async fn handle(
            &self,
            tx: &mut Self::Tx,
            event: Self::Event,
        ) -> #private::Result<(), #private::HandlerError> {
            let result = #name::#call(tx, #single).await;
            #into
        }

        #handle_batch
    };

    let common = quote! {
        fn scope(&self) -> &str {
            #scope
        }

        fn ttl(&self) -> #private::Ttl {
            const TTL: #private::Ttl = #private::ttl_from_secs(#ttl_secs);
            TTL
        }

        fn key(
            &self,
            #uses_event: &Self::Event,
            #uses_headers: &dyn #private::Headers,
        ) -> #private::Result<#private::String, #private::KeyError> {
            #key_body
        }

        #fingerprint_fn

        #decode_fn
    };
    let effect_impl = match args.lease_secs {
        None => quote! {
            impl #private::Handler for #name {
                type Tx = #tx;

                #handle_fns
            }
        },
        Some(lease_secs) => quote! {
            impl #private::LeaseHandler for #name {
                fn lease(&self) -> #private::Ttl {
                    const LEASE: #private::Ttl = #private::ttl_from_secs(#lease_secs);
                    LEASE
                }

                async fn handle(
                    &self,
                    lease: &#private::Lease,
                    event: Self::Event,
                ) -> #private::Result<(), #private::HandlerError> {
                    let result = #name::#call(lease, #single).await;
                    #into
                }
            }
        },
    };

    quote! {
        #(#cfgs)*
        #(#docs)*
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, Default)]
        #vis struct #name;

        #(#cfgs)*
        impl #name {
            /// The handler body exactly as written, without claiming: call it
            /// from unit tests.
            #[allow(dead_code)]
            #(#body_attrs)*
            #vis async fn #call(#inputs) #output #block
        }

        #(#cfgs)*
        impl #private::Describe for #name {
            type Event = #event_type;

            #common
        }

        #(#cfgs)*
        #effect_impl
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generates_a_unit_struct_and_keeps_the_body() {
        let out = idempotent(
            quote!(key = "event_id", ttl = "4h"),
            quote!(
                pub async fn record(tx: &mut Tx, ev: Ev) -> Result<(), E> {
                    body();
                    Ok(())
                }
            ),
        )
        .to_string();
        assert!(out.contains("pub struct record"), "{out}");
        assert!(out.contains("body ()"), "{out}");
        assert!(out.contains("ttl_from_secs (14400u64)"), "{out}");
        assert!(!out.contains("compile_error"), "{out}");
    }

    #[test]
    fn docs_and_cfg_go_on_the_struct_other_attributes_on_the_body() {
        let out = idempotent(
            quote!(key = "event_id", ttl = "4h"),
            quote!(
                /// Records a payment.
                #[deprecated = "use record_v2"]
                #[cfg(feature = "payments")]
                #[tracing::instrument(skip(tx))]
                #[allow(unused_variables)]
                pub async fn record(tx: &mut Tx, ev: Ev) -> Result<(), E> {
                    Ok(())
                }
            ),
        )
        .to_string();
        let cfg = "# [cfg (feature = \"payments\")]";
        let strukt = out.find("pub struct record").expect("struct");
        let call = out.find("async fn call").expect("call");
        let handler = out.find("Handler for record").expect("impl Handler");
        let before = |at: usize| &out[..at];
        // Each item carries the cfg: the struct, `impl record`,
        // `impl Describe`, `impl Handler`.
        assert_eq!(before(strukt).matches(cfg).count(), 1, "{out}");
        assert_eq!(before(handler).matches(cfg).count(), 4, "{out}");
        assert_eq!(out.matches(cfg).count(), 4, "{out}");
        // The doc and the deprecation are on the struct.
        let doc = out.find("Records a payment").expect("doc");
        let deprecated = out.find("deprecated").expect("deprecated");
        assert!(doc < strukt && deprecated < strukt, "{out}");
        // instrument and allow are on `call`, after the struct.
        let instrument = out.find("tracing :: instrument").expect("instrument");
        let allow = out.find("allow (unused_variables)").expect("allow");
        assert!(strukt < instrument && instrument < call, "{out}");
        assert!(strukt < allow && allow < call, "{out}");
    }

    #[test]
    fn a_composite_key_names_each_part() {
        let out = idempotent(
            quote!(key = "tenant.id, header:event-id", ttl = "4h"),
            quote!(
                async fn record(tx: &mut Tx, ev: Ev) -> Result<(), E> {
                    Ok(())
                }
            ),
        )
        .to_string();
        assert!(out.contains("composite_key"), "{out}");
        assert!(out.contains("(\"tenant.id\" ,"), "{out}");
        assert!(out.contains("(\"header:event-id\" ,"), "{out}");
        assert!(
            out.contains("key_from_header (headers , \"event-id\")"),
            "{out}"
        );
        assert!(!out.contains("compile_error"), "{out}");
    }

    #[test]
    fn lease_mode_generates_a_lease_handler() {
        let out = idempotent(
            quote!(key = "event_id", ttl = "4h", lease = "30s"),
            quote!(
                async fn charge(lease: &Lease, ev: Ev) -> Result<(), E> {
                    Ok(())
                }
            ),
        )
        .to_string();
        assert!(out.contains("LeaseHandler for charge"), "{out}");
        assert!(out.contains("ttl_from_secs (30u64)"), "{out}");
        assert!(!out.contains("type Tx"), "{out}");
        assert!(!out.contains("compile_error"), "{out}");
        let out = idempotent(
            quote!(key = "event_id", ttl = "4h", lease = "30s"),
            quote!(
                async fn charge(tx: &mut Tx, ev: Ev) -> Result<(), E> {
                    Ok(())
                }
            ),
        )
        .to_string();
        assert!(out.contains("`lease: &Lease`"), "{out}");
    }

    #[test]
    fn errors_keep_the_original_function() {
        let out = idempotent(
            quote!(ttl = "4h"),
            quote!(
                fn record(tx: &mut Tx, ev: Ev) {}
            ),
        )
        .to_string();
        assert!(out.contains("fn record"), "{out}");
        assert!(out.contains("missing required option `key`"), "{out}");
        assert!(out.contains("must be `async fn`"), "{out}");
    }
}
