use super::*;

/// Arrays are equal by content, whether they share an allocation or not, and a view of
/// part of one allocation is not the whole.
#[test]
fn arrays_are_equal_by_content() {
    let shared: Arc<[i32]> = vec![3, 1, 2].into();
    let same = Array::Shared(shared.clone());
    assert!(Array::Shared(shared.clone()) == same);
    assert!(Array::Shared(vec![3, 1, 2].into()) == same);
    assert!(Array::Borrowed(&shared[..]) == same);
    assert!(Array::Borrowed(&shared[..2]) != same);
    assert!(Array::Shared(vec![3, 1, 4].into()) != same);
    assert!(Array::<i32>::Borrowed(&[]) == Array::Shared(Vec::new().into()));
}
